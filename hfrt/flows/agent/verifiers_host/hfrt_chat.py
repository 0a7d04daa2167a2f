"""The `hfrt_chat` verifiers harness: verifiers' own chat program (the `null` harness's: the
task's prompt, its MCP tools, turns until the model stops calling them), run with the Python
that runs this file instead of a uv-provisioned interpreter, so a rollout needs no network.

Runs in the verifiers venv (imported by verifiers as the harness `hfrt_chat`, never by hfrt):
the chat program's packages (openai, mcp, httpx, tenacity) are verifiers' own requirements.
It knows the verifiers 0.4 harness contract; nothing of hfrt.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from verifiers.v1.harnesses.null.harness import NullHarness

__all__ = ["HfrtChatHarness"]

#: where the chat program's source is written once per content hash
PROGRAM_DIR = Path(tempfile.gettempdir()) / "hfrt-verifiers-programs"


class LocalPython:
    """A verifiers Runtime that runs a PEP 723 script with this interpreter (its dependencies are
    already installed here) instead of syncing it with uv; everything else is the wrapped
    runtime's. Only the subprocess runtime, whose files are the host's, can be wrapped."""

    def __init__(self, runtime: Any) -> None:
        if getattr(runtime, "type", None) != "subprocess":
            raise ValueError(f"the hfrt_chat harness runs on the subprocess runtime only, not {getattr(runtime, 'type', runtime)!r}")
        self._runtime = runtime

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        PROGRAM_DIR.mkdir(parents=True, exist_ok=True)
        path = PROGRAM_DIR / f"{hashlib.sha256(data).hexdigest()}.py"
        if not path.exists():
            partial = path.with_suffix(f".{id(self)}.tmp")
            partial.write_bytes(data)
            partial.replace(path)
        return [sys.executable, str(path)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)


class HfrtChatHarness(NullHarness):
    """verifiers' chat loop (system prompt, prompt, MCP tools, turns) with this interpreter."""

    async def setup(self, runtime: Any) -> None:
        """Nothing to provision: the program's packages are installed beside verifiers."""

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: dict[str, str],
                     data: Any, tool_interception_url: str | None = None) -> Any:
        return await super().launch(ctx, trace, LocalPython(runtime), endpoint, secret, mcp_urls, data, tool_interception_url)


