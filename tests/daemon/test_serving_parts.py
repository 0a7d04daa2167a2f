"""The daemon server's collaborators through their own interfaces, without sockets or processes:
what Replies sends for each outcome, how StreamRunner steps a generator endpoint (one step per
loop turn, partials in order, a cancel closing the generator), what TensorServing answers and
records, and what the server does with each heartbeat event."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

import pytest
from structlog.testing import capture_logs

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.heartbeat import HeartbeatEvent
from hfrt.daemon.replies import Replies
from hfrt.daemon.running import RunningCalls
from hfrt.daemon.server import EXIT_ORPHANED, DaemonServer, ServeConfig
from hfrt.daemon.streaming import StreamRunner
from hfrt.daemon.tensor_serving import TensorServing
from hfrt.log import get_logger
from hfrt.protocols import Call, Error, Hello, Message, Partial, Reply, TensorHandle, Wire, new_key
from hfrt.wire.endpoints import endpoint, endpoint_table

pytestmark = pytest.mark.timeout(30)


class Outbox:
    """Replies over a real Wire whose frames are kept, and the RunningCalls they consult."""

    def __init__(self, export: Any = lambda value: value) -> None:
        self.wire = Wire(new_key())
        self.frames: list[list[Any]] = []
        self.forgotten: list[int] = []
        self.running = RunningCalls(get_logger(part="test"), self.forgotten.append)
        self.replies = Replies(self.wire, self.frames.append, self.running, export, get_logger(part="test"))

    def sent(self) -> list[Message]:
        return [self.wire.unpack(f) for f in self.frames]


def call(call_id: int = 1, endpoint_name: str = "f", reply: bool = True) -> Call:
    return Call(call_id, endpoint_name, [], {}, reply)


def test_a_result_is_replied_unless_no_reply_is_wanted() -> None:
    out = Outbox(export=lambda value: {"exported": value})
    out.replies.result(call(1), 5, 0.25)
    out.replies.result(call(2, reply=False), 6, 0.25)
    [reply] = out.sent()
    assert isinstance(reply, Reply) and reply.call_id == 1 and reply.value == {"exported": 5}


def test_a_reply_a_cancel_asked_to_drop_is_not_sent_but_an_error_is() -> None:
    out = Outbox()
    out.running.skip_reply.update({1, 2})  # threaded calls cancelled while in their thread
    out.replies.result(call(1), "late", 0.1)
    try:
        raise ValueError("boom")
    except ValueError as exc:
        out.replies.raised(call(2), exc)
    [error] = out.sent()
    assert isinstance(error, Error) and (error.call_id, error.type, error.message) == (2, "ValueError", "boom")
    assert "raise ValueError" in error.traceback


def test_a_result_that_cannot_be_stored_or_encoded_fails_the_call_naming_why() -> None:
    def refuse(value: Any) -> Any:
        raise OSError("no space left on /dev/shm")

    out = Outbox(export=refuse)
    out.replies.result(call(1, "gen"), 1, 0.0)
    unencodable = Outbox()
    unencodable.replies.result(call(3, "gen"), object(), 0.0)
    [stored] = out.sent()
    [encoded] = unencodable.sent()
    assert isinstance(stored, Error) and stored.type == "ResultNotStored" and "no space left" in stored.message
    assert isinstance(encoded, Error) and encoded.type == "UnencodableResult"
    assert encoded.message.startswith("gen returned a value hfrt cannot send")


def test_a_partial_that_cannot_be_sent_raises_naming_the_endpoint() -> None:
    out = Outbox()
    out.replies.partial(call(1, "tokens"), [1, 2])
    with pytest.raises(TypeError, match="tokens yielded a value hfrt cannot send"):
        out.replies.partial(call(1, "tokens"), object())
    assert [type(m) for m in out.sent()] == [Partial]


class Counter:
    def __init__(self) -> None:
        self.closed = False

    def count(self, n: int) -> Generator[int, None, str]:
        try:
            yield from range(n)
            return f"counted {n}"
        finally:
            self.closed = True


def runner(out: Outbox) -> StreamRunner:
    loop = asyncio.get_running_loop()

    def start(c: Call, coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        return out.running.start(loop, c, coro)

    return StreamRunner(start, lambda c: (c.args, c.kwargs), out.replies)


async def test_a_stream_sends_one_partial_per_loop_turn_then_its_result() -> None:
    out = Outbox()
    target = Counter()
    task = runner(out).start(Call(4, "count", [3], {}, True), Counter.count, target)
    await asyncio.sleep(0)
    assert [m.value for m in out.sent() if isinstance(m, Partial)] == [0], "one step per loop turn"
    await task
    sent = out.sent()
    assert [m.value for m in sent if isinstance(m, Partial)] == [0, 1, 2]
    assert isinstance(sent[-1], Reply) and sent[-1].value == "counted 3" and target.closed
    assert out.forgotten == [4] and 4 not in out.running.tasks


async def test_cancelling_a_stream_closes_its_generator_and_sends_nothing_more() -> None:
    out = Outbox()
    target = Counter()
    task = runner(out).start(Call(5, "count", [1000], {}, True), Counter.count, target)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert out.running.cancel(5)
    with pytest.raises(asyncio.CancelledError):
        await task
    sent_then = len(out.frames)
    await asyncio.sleep(0)
    assert target.closed and len(out.frames) == sent_then and sent_then < 5
    assert not any(isinstance(m, Reply) for m in out.sent())


async def test_a_stream_that_raises_or_yields_the_unsendable_fails_its_call() -> None:
    def bad(_: Any) -> Generator[Any, None, None]:
        yield object()

    out = Outbox()
    with capture_logs():
        await runner(out).start(call(6, "bad"), bad, None)
    [error] = out.sent()
    assert isinstance(error, Error) and error.type == "TypeError" and "bad yielded a value hfrt cannot send" in error.message


class Raw(Daemon):
    @endpoint(raw_handles=True)
    def pull(self, handle: Any) -> None: ...

    @endpoint
    def use(self, handle: Any) -> None: ...


def test_tensor_serving_passes_arguments_through_unless_they_hold_handles_to_resolve() -> None:
    serving = TensorServing("raw:0", new_key(), {}, endpoint_table(Raw))
    handle = TensorHandle("other:0", "k", (1,), "float32", "cpu", 4)
    plain = Call(1, "use", [1], {"x": 2}, True)
    assert serving.arguments(plain) == ([1], {"x": 2})
    raw = Call(2, "pull", [handle], {}, True)
    serving.note_handles(2)
    assert serving.remembers(2)
    assert serving.arguments(raw) == ([handle], {}), "a raw_handles endpoint gets its handles unresolved"
    assert not serving.remembers(2)
    serving.note_handles(3)
    serving.forget(3)
    assert not serving.remembers(3)


def test_tensor_serving_answers_the_directory_frees_and_stats_without_a_runtime() -> None:
    serving = TensorServing("raw:0", new_key(), {}, endpoint_table(Raw))
    directory = {"other:0": {"data": "tcp://h:1", "host": "h", "pid": 1, "plane_rank": -1}}
    assert serving.internal(Call(1, "_hfrt_peers", [directory], {}, False)) is None
    assert serving.internal(Call(2, "_hfrt_free", [["k"]], {}, False)) is None
    assert serving.internal(Call(3, "_hfrt_stats", [], {}, True)) == {"store_tensors": 0, "store_bytes": 0}
    assert serving.address == "", "not started: no data-plane server, no runtime"
    serving.close()


class Quiet(Daemon):
    pass


async def test_the_server_says_hello_again_or_stops_as_its_heartbeat_tells_it() -> None:
    key = new_key()
    server = DaemonServer(Quiet, DaemonContext("quiet"), ServeConfig("tcp://127.0.0.1:9"), key)
    server._loop = asyncio.get_running_loop()
    server._stopped = server._loop.create_future()
    frames: list[list[Any]] = []
    server._send_frames = frames.append  # type: ignore[method-assign]  # stands in for the socket
    server._on_heartbeat_event(HeartbeatEvent.REHELLO, "s2")
    assert [type(Wire(key).unpack(f)) for f in frames] == [Hello]
    server._on_heartbeat_event(HeartbeatEvent.ORPHANED, "no word from the controller for 61.0s")
    assert server._stopped.result() == ("orphaned: no word from the controller for 61.0s", EXIT_ORPHANED, 0.0)
