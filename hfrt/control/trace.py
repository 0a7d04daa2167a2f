"""Chrome trace of the controller's calls: the controller appends one span per finished call, and
the spans become Chrome trace JSON (open it in Perfetto or chrome://tracing).

Two ways to keep them. Streamed to a file (what a run does: RUN_DIR/trace.json): spans are written
in batches as they finish, so memory stays flat however long the run; the file is the JSON array
format, whose closing bracket Perfetto and chrome://tracing do not need, so a file cut short by a
kill still loads (`read_events` reads one too). Or in memory (no file): the latest `max_spans`,
written out on demand.

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
from typing import IO, Any

from hfrt.log import get_logger

#: Spans kept in memory when not streaming (the latest ones; a span costs about 200 bytes).
MAX_SPANS = 1_000_000
#: When streaming, spans are written once this many are waiting, or FLUSH_S after the last write.
FLUSH_EVERY = 4096
FLUSH_S = 1.0
#: Calls to one daemon that overlap in time (queued behind each other) go to extra rows of its
#: rank: row k > 0 has tid = rank + k * LANE_TID, with at most MAX_ROWS rows per daemon.
LANE_TID = 100_000
MAX_ROWS = 64

#: (identity "role:rank", endpoint, call id, sent, settled (time.perf_counter s), status)
Span = tuple[str, str, int, float, float, str]
#: statuses: the call's reply came back, an error came back, it timed out, its daemon went away,
#: the caller cancelled it, or it was sent without asking for a reply
STATUSES = ("ok", "error", "timeout", "gone", "cancelled", "sent")
#: names of the two global instant events that open and close a trace file
START_EVENT, END_EVENT = "hfrt trace start", "hfrt trace end"


class CallTrace:
    """The controller's span recorder; `add` is its only hot-path method (one perf_counter, one
    tuple, one deque append; when streaming, every FLUSH_EVERY spans or FLUSH_S, one batched write).

    path: stream the spans to this file (Chrome trace JSON) and keep only the unwritten batch in
    `spans`; `close()` ends the file. Without it, `spans` keeps the latest `max_spans` and
    `write(path)` saves them.
    """

    __slots__ = ("spans", "recorded", "origin", "wall_origin", "path", "_file", "_encoder", "_flushed_at", "_lost")

    def __init__(self, max_spans: int = MAX_SPANS, path: str | Path | None = None) -> None:
        self.recorded = 0
        self.origin = time.perf_counter()
        self.wall_origin = time.time()
        self.path = Path(path) if path is not None else None
        self.spans: deque[Span] = deque(maxlen=None if path is not None else max_spans)
        self._file: IO[str] | None = None
        self._encoder = ChromeEncoder(self.origin)
        self._flushed_at = self.origin
        self._lost = 0  # spans a failed write could not save
        if self.path is not None:
            self._file = self.path.open("w")
            self._file.write("[\n" + _json(self._marker(START_EVENT, {"wall_clock_origin_s": self.wall_origin})))
            self._file.flush()

    def add(self, identity: str, endpoint: str, call_id: int, sent: float, status: str) -> None:
        """Record a call settled now (`sent`: its time.perf_counter() when it went out)."""
        now = time.perf_counter()
        self.spans.append((identity, endpoint, call_id, sent, now, status))
        self.recorded += 1
        if self.path is not None and (len(self.spans) >= FLUSH_EVERY or now - self._flushed_at >= FLUSH_S):
            self.flush()

    @property
    def dropped(self) -> int:
        """Spans recorded but in neither `spans` nor the file (pushed out of the in-memory
        buffer by newer ones, or lost to a failed write)."""
        if self.path is not None:
            return self._lost
        return self.recorded - len(self.spans)

    def flush(self) -> None:
        """Append the waiting spans to the file (streaming only). A write that fails is logged and
        ends streaming: a full disk must not fail the calls being recorded."""
        self._flushed_at = time.perf_counter()
        if self.path is None or not self.spans:
            return
        batch = list(self.spans)
        self.spans.clear()
        if self._file is None:  # closed, or abandoned after a failed write
            self._lost += len(batch)
            return
        try:
            self._file.write("".join(",\n" + line for line in self._encoder.lines(batch)))
            self._file.flush()
        except OSError as exc:
            self._lost += len(batch)
            self._abandon(exc)

    def close(self) -> Path | None:
        """Write what is waiting and end the file with its closing bracket; returns the path (None
        when not streaming or when writing failed). Safe to call twice."""
        if self._file is None:
            return None
        self.flush()
        if self._file is None:
            return None
        end = self._marker(END_EVENT, {"spans": self.recorded, "dropped": self.dropped})
        try:
            self._file.write(",\n" + _json(end) + "\n]\n")
            self._file.close()
        except OSError as exc:
            self._abandon(exc)
            return None
        self._file = None
        return self.path

    def write(self, path: str | Path) -> Path:
        """Write the in-memory spans as Chrome trace JSON to `path` (atomically: a reader never sees half)."""
        p = Path(path)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        with tmp.open("w") as f:
            f.write("[\n" + _json(self._marker(START_EVENT, {"wall_clock_origin_s": self.wall_origin})))
            for line in ChromeEncoder(self.origin).lines(self.spans):
                f.write(",\n" + line)
            end = self._marker(END_EVENT, {"spans": len(self.spans), "dropped": self.dropped})
            f.write(",\n" + _json(end) + "\n]\n")
        tmp.replace(p)
        return p

    def _marker(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        """A global instant event (a line across the whole trace) carrying facts about the trace."""
        ts = round((time.perf_counter() - self.origin) * 1e6, 3)
        return {"ph": "i", "s": "g", "name": name, "pid": 0, "tid": 0, "ts": ts, "args": args}

    def _abandon(self, exc: OSError) -> None:
        get_logger(part="trace").warning("trace_write_failed", path=str(self.path), error=str(exc))
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file, also of one cut short (no closing bracket, a half-written last
    event), as Perfetto reads it."""
    text = Path(path).read_text().rstrip()
    if text.endswith("]"):
        try:
            return list(json.loads(text))
        except ValueError:
            pass
    body = text.removeprefix("[").rstrip().rstrip(",")
    events = []
    for line in body.split(",\n"):
        try:
            events.append(json.loads(line))
        except ValueError:
            break  # the last event was being written when the run stopped
    return events


class ChromeEncoder:
    """Turns spans into Chrome trace events (JSON text, one event per string), batch after batch,
    keeping the rows and names it has given out: one "X" (complete) event per span, named after the
    endpoint, with pid = one per role (named after it), tid = the rank (named "rank R"), ts/dur in
    µs from `origin`, args = call id and status, red (cname "terrible") unless ok; a call sent
    without a reply is an "i" (instant) event instead. Plus the "M" events that name processes and
    threads, the first time each appears. Span events are %-formatted, not json.dumps'd (~4x
    faster): the endpoint name is JSON-escaped once, every other field is a number or a status word."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self._pids: dict[str, int] = {}  # role -> pid
        #: identity -> (pid, rank, heap of (end of its last span, row))
        self._who: dict[str, tuple[int, int, list[tuple[float, int]]]] = {}
        self._named: set[tuple[int, int]] = set()
        self._names: dict[str, str] = {}  # endpoint -> its JSON string

    def lines(self, spans: Iterable[Span]) -> Iterator[str]:
        for identity, endpoint, call_id, sent, settled, status in sorted(spans, key=lambda s: s[3]):
            who = self._who.get(identity)
            if who is None:
                yield from self._new_daemon(identity)
                who = self._who[identity]
            pid, rank, rows = who
            lane = 0 if status == "sent" else _free_row(rows, sent, settled)
            tid = rank + lane * LANE_TID
            if (pid, tid) not in self._named:
                self._named.add((pid, tid))
                label = f"rank {rank}" if lane == 0 else f"rank {rank} (overlapping calls {lane})"
                yield _json({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
                yield _json({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
            name = self._names.get(endpoint) or self._names.setdefault(endpoint, json.dumps(endpoint))
            yield _span_event(name, call_id, sent - self.origin, settled - sent, status, pid, tid)

    def _new_daemon(self, identity: str) -> Iterator[str]:
        """Give a daemon first seen its role's pid (naming the role the first time) and its rows."""
        role, rank = _split(identity)
        pid = self._pids.get(role)
        if pid is None:
            pid = self._pids[role] = len(self._pids) + 1
            yield _json({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": role}})
            yield _json({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        self._who[identity] = (pid, rank, [])


#: a span's event, %-formatted (the fastest way here): name (already JSON), status, pid, tid,
#: ts, [dur,] call id, status, [cname]
_X = '{"ph":"X","name":%s,"cat":"%s","pid":%d,"tid":%d,"ts":%.3f,"dur":%.3f,"args":{"call_id":%d,"status":"%s"}%s}'
_I = '{"ph":"i","s":"t","name":%s,"cat":"%s","pid":%d,"tid":%d,"ts":%.3f,"args":{"call_id":%d,"status":"%s"}}'


def _span_event(name: str, call_id: int, start: float, took: float, status: str, pid: int, tid: int) -> str:
    """One span's event; `name` is already JSON, `status` one of STATUSES."""
    if status == "sent":
        return _I % (name, status, pid, tid, start * 1e6, call_id, status)
    if status not in STATUSES:
        raise ValueError(f"call trace: unknown span status {status!r} (one of {', '.join(STATUSES)})")
    red = "" if status == "ok" else ',"cname":"terrible"'  # red in chrome://tracing
    return _X % (name, status, pid, tid, start * 1e6, max(0.0, took) * 1e6, call_id, status, red)


def _json(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))


def _free_row(rows: list[tuple[float, int]], start: float, end: float) -> int:
    """The row (of a heap of (busy until, row)) that ended earliest if it ended by `start`, else a
    new one, now busy until `end`: the slices of one Chrome-trace thread must nest, and queued
    calls to one daemon overlap. Past MAX_ROWS rows, the earliest-ending row is reused anyway.
    Batches may arrive out of order (a long call settles after later short ones): a span only
    ever goes to a row that is free for it, so rows stay valid, only perhaps more numerous."""
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
