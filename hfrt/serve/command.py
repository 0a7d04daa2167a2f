"""What `hfrt serve-openai` runs: the API key it requires, and the flow that serves the run's
rollout role over HTTP until stopped, with a dead rollout daemon replaced by recovery (the server
answers 503 with Retry-After meanwhile).

Controller-side (no torch). It knows the controller's role lookup and recovery hooks, and the
OpenAIServer; nothing of the routes or of sampling.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hfrt.serve.server import OpenAIServer


def api_key_from(key: str = "", key_file: str = "") -> str | None:
    """The API key to require: `key`, else the first line of `key_file`, else $HFRT_API_KEY, else
    None (no authentication). An empty key file is a ValueError."""
    if key:
        return key
    if key_file:
        lines = Path(key_file).read_text().strip().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"the API key file {key_file} is empty")
        return lines[0].strip()
    return os.environ.get("HFRT_API_KEY") or None


async def _same_weights(replaced: list[str]) -> None:
    """Recovery's hook for a replaced serving daemon: nothing to push (it loads the `model`
    option's weights at start, which is what the server serves)."""


def serve_flow(*, host: str, port: int, model: str, start_timeout_s: float = 600.0, **options: Any) -> Any:
    """A flow (`async def flow(ctl, config)`) that serves the run's `rollout` role over HTTP until
    cancelled; `hfrt serve-openai` runs it with local rollout daemons and recovery on, so a
    rollout daemon that dies is relaunched (the server answers 503 with Retry-After until its
    replacement said hello). `options` go to OpenAIServer (batch_size, flush_after_s, idle_flush,
    limits, api_key, tool_parser)."""

    async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        rollout = await ctl.role("rollout", timeout_s=start_timeout_s)
        recovery = getattr(ctl, "recovery", None)
        if recovery is not None:
            recovery.on_restart("rollout", _same_weights)

        def replacing() -> bool:
            return recovery is not None and recovery.failure is None and not recovery.closing

        async with OpenAIServer(rollout, host=host, port=port, model=model, replacing=replacing, **options) as server:
            print(f"hfrt serve-openai: serving {model!r} at {server.url} (Ctrl-C stops)", flush=True)
            try:
                await server.serve_forever()
            finally:
                print(f"hfrt serve-openai: stopping after {server.requests} requests, "
                      f"{server.generate_calls} generate_turn calls", flush=True)
        return {}

    return flow
