"""Small process helpers the ssh and slurm launchers share: run a command, end child processes,
read the tail of a log. They know subprocesses and files; they know nothing of daemons.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterable
from pathlib import Path


async def run_command(argv: list[str], *, timeout_s: float = 30.0, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run argv to completion; returns (exit code, stdout, stderr). A timeout kills it (code -9)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env,
        )
    except OSError as exc:
        return 127, "", f"cannot run {argv[0]}: {exc.strerror}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        _signal(proc, signal.SIGKILL)
        await proc.wait()
        raise
    return int(proc.returncode or 0), out.decode(errors="replace"), err.decode(errors="replace")


async def end_processes(procs: Iterable[asyncio.subprocess.Process], grace_s: float) -> None:
    """Wait up to grace_s for procs to exit, then SIGTERM, then SIGKILL (each with a short wait)."""
    procs = [p for p in procs if p.returncode is None]
    if procs and grace_s > 0:
        await _wait_all(procs, grace_s)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        live = [p for p in procs if p.returncode is None]
        if not live:
            return
        for proc in live:
            _signal(proc, sig)
        await _wait_all(live, wait_s)


def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # launchers start children in their own session: reach helpers too
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


async def _wait_all(procs: list[asyncio.subprocess.Process], timeout_s: float) -> None:
    await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)


def tail(path: str | Path, lines: int = 12, max_bytes: int = 8192) -> str:
    """The last `lines` non-empty lines of a text file ('' when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def exit_reason(code: int | None) -> str:
    """'exited with code N' or 'killed by SIGNAME' for a subprocess return code."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def with_tail(reason: str, log: str | Path, lines: int = 12) -> str:
    """`reason`, followed by the last lines of `log` when it has any."""
    text = tail(log, lines)
    return f"{reason}; last lines of {log}:\n{text}" if text else reason
