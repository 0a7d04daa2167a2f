"""Tools for agent flows: a plain Python function run with a time limit, and Python code run in a
sandboxed subprocess (its own session, rlimits on address space, CPU time, file size and open
files, a wall-clock timeout, the whole process group killed on overrun, output capped).

The sandbox limits resources; it is not a security boundary against hostile code (no namespaces,
no seccomp): run untrusted model code in a container as well. It knows nothing of models or flows.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ToolError(RuntimeError):
    """A tool hung, crashed or overran a limit; the message names the tool and what happened."""


@dataclass(frozen=True)
class SandboxLimits:
    """timeout_s: wall clock; cpu_s: CPU seconds (RLIMIT_CPU); memory_mb: address space
    (RLIMIT_AS); output_bytes: stdout/stderr kept (each); file_mb: largest file it may write."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 16384
    file_mb: int = 16

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "output_bytes", "file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r}: must be > 0")


@dataclass(frozen=True)
class SandboxResult:
    """What the code did: exit code (negative: killed by that signal), output (capped), and
    `error`: "" when it ran to the end, else why it was stopped (timeout, memory, cpu)."""

    returncode: int
    stdout: str
    stderr: str
    error: str = ""


def _limit(limits: SandboxLimits) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        mem = limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 2**20,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _why(returncode: int, stderr: str, limits: SandboxLimits) -> str:
    if "MemoryError" in stderr or returncode == -signal.SIGSEGV and "memory" in stderr.lower():
        return f"memory limit ({limits.memory_mb} MB) exceeded"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"CPU time limit ({limits.cpu_s} s) exceeded"
    return ""


async def run_python(code: str, limits: SandboxLimits | None = None, *, stdin: str = "") -> SandboxResult:
    """Run `code` with `python -I` in a fresh temporary directory under `limits`; on a wall-clock
    overrun the process group is killed (SIGKILL) and error says so."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="hfrt-sandbox-") as cwd:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", code, cwd=cwd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, preexec_fn=_limit(limits),
            env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), limits.timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            out, err = await proc.communicate()
            return SandboxResult(proc.returncode or -9, _cap(out, limits), _cap(err, limits),
                                 f"timed out after {limits.timeout_s} s (killed)")
        except BaseException:
            _kill_group(proc.pid)
            await proc.wait()
            raise
    code_ = proc.returncode if proc.returncode is not None else -1
    stderr = _cap(err, limits)
    return SandboxResult(code_, _cap(out, limits), stderr, _why(code_, stderr, limits))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cap(data: bytes, limits: SandboxLimits) -> str:
    return data[: limits.output_bytes].decode("utf-8", errors="replace")


async def call_tool(fn: Callable[..., Any], *args: Any, timeout_s: float = 5.0, name: str | None = None) -> Any:
    """fn(*args) in its own daemon thread (the event loop keeps running); ToolError naming the
    tool if it raises or runs past timeout_s. A hung thread cannot be killed: it is left behind
    (a daemon thread) and its result ignored; put code that may hang in `run_python` instead."""
    label = name or getattr(fn, "__name__", repr(fn))
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def work() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller as a ToolError
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is gone (a hung tool that finished after its run ended)

    threading.Thread(target=work, name=f"hfrt-tool-{label}", daemon=True).start()
    try:
        return await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        raise ToolError(f"tool {label} timed out after {timeout_s} s") from None
    except Exception as exc:
        raise ToolError(f"tool {label} raised {type(exc).__name__}: {exc}") from exc
