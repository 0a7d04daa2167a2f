"""Chrome trace of the controller's calls: a bounded buffer of spans the controller appends one
tuple to per finished call, and a writer that turns them into Chrome trace JSON (open it in
Perfetto or chrome://tracing).

It knows a span as (daemon identity "role:rank", endpoint, call id, sent, settled, status); nothing
of sockets, flows or what a call computes.
"""

from __future__ import annotations

import heapq
import json
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: Spans kept (the latest ones); a span costs about 200 bytes, so the buffer stays under ~200 MB.
MAX_SPANS = 1_000_000
#: Calls to one daemon that overlap in time (queued behind each other) go to extra rows of its
#: rank: row k > 0 has tid = rank + k * LANE_TID, with at most MAX_ROWS rows per daemon.
LANE_TID = 100_000
MAX_ROWS = 64

#: (identity "role:rank", endpoint, call id, sent, settled (time.perf_counter s), status)
Span = tuple[str, str, int, float, float, str]
#: statuses: the call's reply came back, an error came back, it timed out, its daemon went away,
#: the caller cancelled it, or it was sent without asking for a reply
STATUSES = ("ok", "error", "timeout", "gone", "cancelled", "sent")


class CallTrace:
    """The controller's span buffer; `add` is its only hot-path method (one perf_counter, one
    tuple, one deque append)."""

    __slots__ = ("spans", "recorded", "origin", "wall_origin")

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self.spans: deque[Span] = deque(maxlen=max_spans)
        self.recorded = 0
        self.origin = time.perf_counter()
        self.wall_origin = time.time()

    def add(self, identity: str, endpoint: str, call_id: int, sent: float, status: str) -> None:
        """Record a call settled now (`sent`: its time.perf_counter() when it went out)."""
        self.spans.append((identity, endpoint, call_id, sent, time.perf_counter(), status))
        self.recorded += 1

    @property
    def dropped(self) -> int:
        """Spans pushed out of the buffer by newer ones."""
        return self.recorded - len(self.spans)

    def write(self, path: str | Path) -> Path:
        """Write the spans as Chrome trace JSON to `path` (atomically: a reader never sees half)."""
        p = Path(path)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        with tmp.open("w") as f:
            f.write('{"displayTimeUnit": "ms", "otherData": ')
            f.write(json.dumps({"wall_clock_origin_s": self.wall_origin, "spans": len(self.spans), "dropped": self.dropped}))
            f.write(', "traceEvents": [\n')
            for i, event in enumerate(chrome_events(list(self.spans), self.origin)):
                f.write((",\n" if i else "") + json.dumps(event, separators=(",", ":")))
            f.write("\n]}\n")
        tmp.replace(p)
        return p


def chrome_events(spans: Iterable[Span], origin: float) -> Iterator[dict[str, Any]]:
    """Chrome trace events: one "X" (complete) event per span, named after the endpoint, with
    pid = one per role (named after it), tid = the rank (named "rank R"), ts/dur in µs from
    `origin`, args = call id and status; a call sent without a reply is an "i" (instant) event
    instead. Plus the "M" events that name processes and threads."""
    ordered = sorted(spans, key=lambda s: s[3])
    pids = {role: i + 1 for i, role in enumerate(sorted({_split(s[0])[0] for s in ordered}))}
    lanes: dict[str, list[tuple[float, int]]] = {}  # identity -> heap of (end of its last span, row)
    named: set[tuple[int, int]] = set()
    for role, pid in pids.items():
        yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": role}}
        yield {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
    for identity, endpoint, call_id, sent, settled, status in ordered:
        role, rank = _split(identity)
        rows = lanes.setdefault(identity, [])
        lane = 0 if status == "sent" else _free_row(rows, sent, settled)
        pid, tid = pids[role], rank + lane * LANE_TID
        if (pid, tid) not in named:
            named.add((pid, tid))
            label = f"rank {rank}" if lane == 0 else f"rank {rank} (overlapping calls {lane})"
            yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}}
            yield {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        event: dict[str, Any] = {
            "ph": "X", "name": endpoint, "cat": status, "pid": pid, "tid": tid,
            "ts": round((sent - origin) * 1e6, 3), "dur": round(max(0.0, settled - sent) * 1e6, 3),
            "args": {"call_id": call_id, "status": status},
        }
        if status == "sent":
            del event["dur"]
            event |= {"ph": "i", "s": "t"}
        elif status != "ok":
            event["cname"] = "terrible"  # red in chrome://tracing
        yield event


def _free_row(rows: list[tuple[float, int]], start: float, end: float) -> int:
    """The row (of a heap of (busy until, row)) that ended earliest if it ended by `start`, else a
    new one, now busy until `end`: the slices of one Chrome-trace thread must nest, and queued
    calls to one daemon overlap. Past MAX_ROWS rows, the earliest-ending row is reused anyway."""
    if rows and (rows[0][0] <= start or len(rows) >= MAX_ROWS):
        busy_until, row = heapq.heappop(rows)
        heapq.heappush(rows, (max(busy_until, end), row))
        return row
    heapq.heappush(rows, (end, len(rows)))
    return len(rows) - 1


def _split(identity: str) -> tuple[str, int]:
    role, _, rank = identity.rpartition(":")
    try:
        return (role or identity), int(rank)
    except ValueError:
        return identity, 0
