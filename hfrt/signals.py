"""How a command that starts daemons ends on SIGTERM or SIGINT: the running coroutine is cancelled
(so its `async with Session` stops the daemons, or detaches kept ones, and the trace is closed),
then `Stopped` is raised for the command to print its summary and exit 128 + the signal number.

SIGTERM always stops (a batch system, `kill`, a service manager; also in the background and under
nohup, where a shell has set SIGINT to be ignored). SIGINT stops unless the process was started
with it ignored (a background job of a non-interactive shell), as for any Unix program. A second
signal while stopping is reported and otherwise ignored: stopping is bounded by the launchers'
own timeouts, and SIGKILL remains. It knows signals, the event loop and the run folder's
metrics.jsonl; it knows nothing of daemons or flows.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from hfrt.wire.loop import loop_factory

T = TypeVar("T")


class Stopped(Exception):
    """The command was stopped by signal `signum` after it stopped what it started."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_signals() -> list[int]:
    """SIGTERM, and SIGINT unless this process was started with SIGINT ignored."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    return [signal.SIGTERM] if ignored else [signal.SIGTERM, signal.SIGINT]


def run_stoppable(main: Coroutine[Any, Any, T], *, who: str) -> T:
    """Run `main` to completion (on uvloop when installed); SIGTERM / SIGINT cancel it and, once it
    has unwound, raise Stopped. `who` names the command in the one line printed on the signal."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        loop = runner.get_loop()
        received: list[int] = []
        task: list[asyncio.Task[Any]] = []

        def on_signal(signum: int) -> None:
            name = signal.Signals(signum).name
            if received:
                print(f"{who}: {name} again: still stopping (SIGKILL ends it at once)", file=sys.stderr, flush=True)
                return
            received.append(signum)
            print(f"{who}: {name}: stopping (the daemons it started are shut down)", file=sys.stderr, flush=True)
            if task:
                task[0].cancel(f"stopped by {name}")

        async def guarded() -> T:
            task.append(asyncio.current_task())  # type: ignore[arg-type]
            if received:  # a signal arrived before the coroutine started
                raise Stopped(received[0])
            return await main

        handled = stop_signals()
        for sig in handled:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return runner.run(guarded())
        except (asyncio.CancelledError, Exception):
            if received:  # what failed while stopping (a call cut short) is part of the stop
                raise Stopped(received[0]) from None
            raise
        finally:
            main.close()  # never started (a signal came first): no "never awaited" warning
            for sig in handled:
                loop.remove_signal_handler(sig)


def stopped_summary(run_dir: Path, stopped: Stopped) -> dict[str, Any]:
    """What a stopped run leaves: the signal, the steps in RUN_DIR/metrics.jsonl (the last one's
    reward), and where the metrics and the trace are."""
    summary: dict[str, Any] = {"stopped_by": stopped.name, "exit_code": stopped.exit_code, "steps": 0}
    metrics = run_dir / "metrics.jsonl"
    records = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line cut by the stop
    if records:
        summary |= {"steps": len(records), "last_step": records[-1].get("step"), "metrics": str(metrics)}
        if "reward/mean" in records[-1]:
            summary["reward_last"] = records[-1]["reward/mean"]
    if (run_dir / "trace.json").is_file():
        summary["trace"] = str(run_dir / "trace.json")
    if (run_dir / "attach.json").is_file():
        summary["attach"] = str(run_dir / "attach.json")
    return summary
