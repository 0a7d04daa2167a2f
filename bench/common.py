"""What every benchmark shares: the machine facts stamped on a result and how a result is emitted.

Knows JSON and stdout; nothing of what was measured.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--out", help="also write the JSON result to this file")


def machine() -> dict[str, Any]:
    """Facts that make two results comparable (or not)."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],  # other work on the machine during the run
    }


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the result to --out, and print it as the last stdout line with --json."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps(result))


def spawn_ranks(rank_main: Callable[..., None], args: tuple[Any, ...], world: int, prefix: str) -> list[dict[str, Any]]:
    """Run `rank_main(rank, port, out_dir, *args)` on `world` spawned processes and return what each
    saved as `out_dir/rank<r>.pt` (a dict with "ok", and "error" when not ok); a rank that failed
    raises RuntimeError with its saved traceback."""
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        ctx = mp.start_processes(rank_main, args=(port, tmp, *args), nprocs=world, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=60):
                pass
        except mp.ProcessExitedException:
            pass  # the failing rank's saved traceback is raised below
        files = [Path(tmp) / f"rank{r}.pt" for r in range(world)]
        results = [torch.load(f, weights_only=False) if f.exists() else {"ok": False, "error": "no result"} for f in files]
    for rank, res in enumerate(results):
        if not res["ok"]:
            raise RuntimeError(f"rank {rank} failed:\n{res['error']}")
    return results


class StepProcess:
    """A reference measured beside hfrt (TRL, the compute floor) in a spawned child process, driven
    one step at a time over a pipe: `step()` sends "go" and returns the child's reply; a reply with
    an "error" raises, naming `what`. `target(*args, conn)` is the child's loop. stop: a message
    sent at close to a child that waits for its next step (None: the child ends by itself)."""

    def __init__(self, target: Callable[..., Any], args: tuple[Any, ...], *, what: str, name: str,
                 stop: str | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.what = what
        self._stop = stop
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
        self.proc.start()
        child.close()

    def receive(self) -> dict[str, Any]:
        try:
            reply: dict[str, Any] = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the {self.what} process exited (code {self.proc.exitcode}) without replying") from None
        if "error" in reply:
            raise RuntimeError(f"the {self.what} process failed: {reply['error']}\n{reply['traceback']}")
        return reply

    def step(self) -> dict[str, Any]:
        self.conn.send("go")
        return self.receive()

    def close(self) -> None:
        if self._stop is not None:
            try:
                self.conn.send(self._stop)
            except OSError:
                pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
