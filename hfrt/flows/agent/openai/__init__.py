"""The OpenAI-compatible HTTP endpoint over a rollout role: request shapes, sessions, the server.

Imports control/ and wire/; no torch.
"""
