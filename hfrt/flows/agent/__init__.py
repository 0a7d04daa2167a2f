"""Agent rollouts, controller side: the agent loop API, the agent GRPO step, tool sandboxes, OpenAI-compatible serving.

Imports control/ and wire/; no torch, nothing from roles.
"""
