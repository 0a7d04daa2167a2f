"""Serving the policy over HTTP: the OpenAI-compatible API (Starlette on uvicorn) over a rollout
role, its request shapes, the batching of turns and the sessions recorded for training.

Imports control/, wire/ and protocols/; never flows/ (flows import serve) and never torch.
"""
