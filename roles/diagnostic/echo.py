"""The echo role: a diagnostic daemon with no model, for smoke tests, the `ping` flow and benchmarks.

Its endpoints exercise every runtime behaviour (ordering, concurrency, errors, cancellation,
split dispatch) and do no real work. It knows nothing of RL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from typing import Any

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.wire.endpoints import Dispatch, endpoint


class EchoDaemon(Daemon):
    def __init__(self, context: DaemonContext) -> None:
        super().__init__(context)
        self.journal: list[Any] = []
        self.gates: dict[str, asyncio.Event] = {}

    @endpoint
    def ping(self) -> str:
        """The no-op round trip the latency benchmark measures."""
        return "pong"

    @endpoint
    def echo(self, value: Any) -> Any:
        return value

    @endpoint
    async def sleep(self, seconds: float, tag: Any = None) -> float:
        """Ordered async sleep; records `tag` in the journal when it starts and ends."""
        self.journal.append(["start", tag])
        await asyncio.sleep(seconds)
        self.journal.append(["end", tag])
        return seconds

    @endpoint
    def block(self, seconds: float, tag: Any = None) -> float:
        """Ordered synchronous busy-wait: holds the serving loop like a real compute step."""
        self.journal.append(["start", tag])
        time.sleep(seconds)
        self.journal.append(["end", tag])
        return seconds

    @endpoint(concurrent=True)
    async def sleep_concurrent(self, seconds: float, tag: Any = None) -> float:
        self.journal.append(["start", tag])
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.journal.append(["cancelled", tag])
            raise
        self.journal.append(["end", tag])
        return seconds

    @endpoint
    async def gate(self, name: str) -> str:
        """Ordered: holds the daemon's queue until `release(name)` (a deterministic blocker for tests)."""
        self.journal.append(["gate", name])
        await self.gates.setdefault(name, asyncio.Event()).wait()
        return name

    @endpoint(concurrent=True)
    def release(self, name: str) -> None:
        self.gates.setdefault(name, asyncio.Event()).set()

    @endpoint
    def record(self, tag: Any) -> int:
        self.journal.append(["record", tag])
        return len(self.journal)

    @endpoint
    def history(self) -> list[Any]:
        return list(self.journal)

    @endpoint
    def fail(self, message: str = "requested failure") -> None:
        raise ValueError(message)

    @endpoint
    def blob(self, nbytes: int) -> bytes:
        return b"x" * nbytes

    @endpoint
    def unsendable(self) -> Any:
        return object()

    @endpoint(stream=True)
    def count(self, n: int, step_s: float = 0.0, fail_at: int = -1) -> Generator[int, None, int]:
        """Streaming: yields 0 .. n-1 (busy for step_s before each, like a sampling step), returns n;
        raises ValueError instead of yielding `fail_at`. The journal records each value and how
        the stream ended ("closed" when the caller cancelled it)."""
        done = False
        try:
            for i in range(n):
                time.sleep(step_s)
                if i == fail_at:
                    raise ValueError(f"count failed at {i}")
                self.journal.append(["count", i])
                yield i
            done = True
            return n
        finally:
            self.journal.append(["count_end" if done else "count_closed", n])

    @endpoint(dispatch=Dispatch.SPLIT)
    def tag_rows(self, rows: list[Any]) -> list[Any]:
        """Split by data-parallel rank: returns each row with the rank that handled it."""
        return [[self.context.rank, row] for row in rows]

    @endpoint(dispatch=Dispatch.RANK0)
    def leader(self) -> int:
        return self.context.rank
