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
    overrun the process group is killed (SIGKILL) and error says so (the output so far is kept)."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="hfrt-sandbox-") as cwd:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", code, cwd=cwd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, preexec_fn=_limit(limits),
            env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        readers = [asyncio.ensure_future(_read(stream, limits.output_bytes)) for stream in (proc.stdout, proc.stderr)]
        error = ""
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
            await asyncio.wait_for(proc.wait(), limits.timeout_s)
        except TimeoutError:
            error = f"timed out after {limits.timeout_s} s (killed)"
        finally:
            _kill_group(proc.pid)  # whatever it started goes too
            await proc.wait()
            done, pending = await asyncio.wait(readers, timeout=2.0)  # a child that left the group may hold the pipes
            for task in pending:
                task.cancel()
    out, err = [task.result().decode("utf-8", errors="replace") if task in done else "" for task in readers]
    returncode = proc.returncode if proc.returncode is not None else -1
    return SandboxResult(returncode, out, err, error or _why(returncode, err, limits))


async def _read(stream: asyncio.StreamReader, cap: int) -> bytes:
    """All of a stream, keeping the first `cap` bytes."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, cap - len(kept))]
    return bytes(kept)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
