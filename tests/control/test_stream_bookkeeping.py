"""The controller's streaming calls through StreamCalls' own interface, without sockets or daemon
processes: which partials reach a stream (and restart its deadline), which are counted as late,
stray or forged, what is remembered once a stream ends, and a CallStream's iteration and result."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from hfrt.control import streams
from hfrt.control.daemons import DaemonInfo
from hfrt.control.pending import Pending
from hfrt.control.strays import StrayReplies
from hfrt.control.streams import CallStream, StreamCalls
from hfrt.log import get_logger
from hfrt.protocols import Partial
from hfrt.wire.errors import RemoteError

pytestmark = pytest.mark.timeout(30)


class Table:
    """Stands in for the controller's side: sends calls (ids from 1), keeps them pending, and
    records deadline restarts."""

    def __init__(self) -> None:
        self.info = DaemonInfo("rollout:0", "rollout", 0, 1, 0, 1, 42, "h", "x", {}, 0.0)
        self.pending: dict[int, Pending] = {}
        self.restarts: list[tuple[int, float]] = []
        self.refuse = False
        self.next_id = 1
        self.stats: dict[str, int] = {"dropped_replies": 0}
        self.strays = StrayReplies(self.stats, get_logger(part="test"))
        self.streams = StreamCalls(self.send, self.pending.get, self.restart, self.stats, self.strays)

    def send(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any],
             timeout_s: float | None) -> tuple[int, asyncio.Future[Any]]:
        call_id, self.next_id = self.next_id, self.next_id + 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.refuse:
            future.set_exception(RuntimeError("not sent"))
        else:
            self.pending[call_id] = Pending(future, info, endpoint, 0.0)
        return call_id, future

    def restart(self, call_id: int, pending: Pending, timeout: float) -> None:
        self.restarts.append((call_id, timeout))

    def answer(self, call_id: int, value: Any) -> None:
        self.pending.pop(call_id).future.set_result(value)


async def test_partials_from_the_daemon_called_reach_the_stream_in_order_and_restart_its_deadline() -> None:
    t = Table()
    stream = t.streams.open(t.info, "generate_turn_stream", [], {}, 5.0)
    t.streams.partial(b"rollout:0", Partial(1, "a"))
    t.streams.partial(b"rollout:0", Partial(1, "b"))
    assert t.restarts == [(1, 5.0), (1, 5.0)] and t.info.last_seen > 0
    t.answer(1, "done")
    assert [part async for part in stream] == ["a", "b"]
    assert await stream.result() == "done" and stream.received == 2


async def test_without_a_timeout_no_deadline_is_restarted() -> None:
    t = Table()
    stream = t.streams.open(t.info, "s", [], {}, None)
    t.streams.partial(b"rollout:0", Partial(1, 7))
    assert t.restarts == [] and stream.received == 1


async def test_a_partial_from_another_peer_is_dropped_and_counted() -> None:
    t = Table()
    stream = t.streams.open(t.info, "s", [], {}, 5.0)
    t.streams.partial(b"rogue:0", Partial(1, "forged"))
    assert t.stats["dropped_replies"] == 1 and stream.received == 0 and t.restarts == []


async def test_partials_after_a_stream_ended_are_late_and_never_ours_are_strays() -> None:
    t = Table()
    stream = t.streams.open(t.info, "s", [], {}, 5.0)
    assert t.streams.open_calls == 1
    await stream.aclose()  # the caller went away: the call is given up on
    t.pending.pop(1)
    await asyncio.sleep(0)  # the future's done-callbacks run
    assert t.streams.open_calls == 0
    t.streams.partial(b"rollout:0", Partial(1, "in flight"))
    assert t.stats["late_partials"] == 1 and t.stats["unmatched_replies"] == 0
    with capture_logs() as logs:
        t.streams.partial(b"rollout:0", Partial(99, "?"))
    assert t.stats["unmatched_replies"] == 1 and [e["kind"] for e in logs] == ["partial"]


async def test_only_the_latest_ended_streams_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "REMEMBER", 2)
    t = Table()
    for call_id in (1, 2, 3):
        t.streams.open(t.info, "s", [], {}, None)
        t.answer(call_id, None)
    await asyncio.sleep(0)
    t.streams.partial(b"rollout:0", Partial(3, "late"))
    t.streams.partial(b"rollout:0", Partial(1, "forgotten"))
    assert t.stats["late_partials"] == 1 and t.stats["unmatched_replies"] == 1


async def test_a_call_refused_before_sending_opens_no_stream_and_raises_from_the_stream() -> None:
    t = Table()
    t.refuse = True
    stream = t.streams.open(t.info, "s", [], {}, 5.0)
    assert t.streams.open_calls == 0
    with pytest.raises(RuntimeError, match="not sent"):
        await anext(stream)


async def test_a_failed_call_raises_from_the_iteration_after_its_partials() -> None:
    t = Table()
    stream = t.streams.open(t.info, "s", [], {}, None)
    t.streams.partial(b"rollout:0", Partial(1, "first"))
    t.pending.pop(1).future.set_exception(RemoteError("rollout[0].s", "ValueError", "bad", ""))
    assert await anext(stream) == "first"
    with pytest.raises(RemoteError, match="bad"):
        await anext(stream)
    with pytest.raises(RemoteError):
        await stream.result()


async def test_leaving_a_stream_early_cancels_its_call() -> None:
    t = Table()
    async with t.streams.open(t.info, "s", [], {}, None) as stream:
        t.streams.partial(b"rollout:0", Partial(1, 0))
        assert await anext(stream) == 0
    assert t.pending[1].future.cancelled()
    assert [part async for part in CallStream(t.pending[1].future)] == []
