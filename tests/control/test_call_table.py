"""The controller's calls in flight through their own interface, without sockets: a group call is one
future over its ranks' calls (values in order, the first failure, cancel reaching every part still
running), its arguments encoded once into the very messages single calls make, and a call naming
handles is preceded by its daemon's missing directory entries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hfrt.control.calls import CallTable
from hfrt.control.daemons import DaemonInfo
from hfrt.control.pending import Pending
from hfrt.control.strays import StrayReplies
from hfrt.protocols import BatchHandle, Call, Error, Reply, Shard, TensorHandle, Wire, new_key
from hfrt.wire.errors import CallTimeout, DaemonGone, RemoteError

pytestmark = pytest.mark.timeout(30)


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


class Table:
    """A CallTable wired to recording stand-ins: what was sent (decoded), introduced and cancelled."""

    def __init__(self, default_timeout_s: float | None = None) -> None:
        self.wire = Wire(new_key())
        self.sent: list[tuple[str, Call]] = []
        self.raw: list[list[Any]] = []
        self.introduced: list[tuple[str, list[Any]]] = []
        self.cancelled: list[tuple[str, int]] = []
        self.stats: dict[str, int] = {"calls_sent": 0, "replies": 0, "errors": 0, "dropped_replies": 0, "dir": 0}
        self.table = CallTable(self.wire, self._send, introduce=lambda i, r: self.introduced.append((i.identity, list(r))),
                               track=lambda v: None, refusal=self._refusal, overdue=lambda c, p, t: False,
                               cancel=lambda i, c: self.cancelled.append((i.identity, c)), strays=StrayReplies(self.stats, Log()),
                               stats=self.stats, log=Log(), default_timeout_s=default_timeout_s, byte_counts={"_dir": "dir"})
        self.table.start(asyncio.get_running_loop())

    def _send(self, info: DaemonInfo, frames: list[Any]) -> None:
        self.raw.append(frames)
        msg = self.wire.unpack([bytes(f) for f in frames])
        assert isinstance(msg, Call)
        self.sent.append((info.identity, msg))

    @staticmethod
    def _refusal(info: DaemonInfo, endpoint: str) -> BaseException | None:
        return None if info.alive else DaemonGone(f"{info.identity} is gone; cannot call {endpoint}")

    def answer(self, identity: str, call_id: int, value: Any) -> None:
        self.table.reply(identity.encode(), Reply(call_id, value, 0.0), 0.0)


def daemons(n: int) -> list[DaemonInfo]:
    return [DaemonInfo(f"r:{i}", "r", i, n, i, n, 100, "h", "x", {}, 0.0) for i in range(n)]


async def test_a_group_call_is_one_future_of_the_values_in_the_order_sent() -> None:
    t = Table()
    infos = daemons(3)
    future = t.table.send_all(infos, "ping", [1], {"k": 2})
    assert [(who, m.endpoint, m.args, m.kwargs) for who, m in t.sent] == [(f"r:{i}", "ping", [1], {"k": 2}) for i in range(3)]
    ids = [m.call_id for _, m in t.sent]
    assert len(set(ids)) == 3 and t.stats["calls_sent"] == 3
    for i in (2, 0, 1):  # replies in any order
        assert not future.done()
        t.answer(f"r:{i}", ids[i], f"v{i}")
    assert await future == ["v0", "v1", "v2"]
    assert t.table.calls == {}


async def test_encoded_once_the_messages_are_those_single_calls_make() -> None:
    t = Table()
    handle = TensorHandle("r:9", "k", (2,), "float32", "cpu", 8)
    t.table.send_all(daemons(2), "take", [handle, {"x": [1.5, None]}], {"y": b"\xff\x00"})
    for frames in t.raw:
        msg = t.wire.unpack(frames)
        assert isinstance(msg, Call)
        assert frames == t.wire.pack(Call(msg.call_id, "take", [handle, {"x": [1.5, None]}], {"y": b"\xff\x00"}, True))
    assert [(who, records) for who, records in t.introduced] == [("r:0", [handle]), ("r:1", [handle])]


async def test_the_first_failure_fails_the_group_call_and_the_other_parts_still_settle() -> None:
    t = Table()
    future = t.table.send_all(daemons(3), "ping", [], {})
    ids = [m.call_id for _, m in t.sent]
    t.table.error(b"r:1", Error(ids[1], "ValueError", "bad"))
    with pytest.raises(RemoteError, match=r"r\[1\]\.ping raised ValueError: bad"):
        await future
    t.answer("r:0", ids[0], 1)
    t.table.fail_all(lambda p: DaemonGone("gone"))
    assert t.table.calls == {}


async def test_cancelling_a_group_call_cancels_every_part_still_running_on_its_daemon() -> None:
    t = Table()
    future = t.table.send_all(daemons(3), "sleep", [5], {})
    ids = [m.call_id for _, m in t.sent]
    t.answer("r:0", ids[0], 0)
    future.cancel()
    await asyncio.sleep(0)
    assert t.cancelled == [("r:1", ids[1]), ("r:2", ids[2])]
    assert t.table.calls == {}


async def test_a_gone_daemon_fails_the_group_call_at_once_and_the_live_ranks_are_still_sent() -> None:
    t = Table()
    infos = daemons(3)
    infos[1].alive = False
    future = t.table.send_each([(d, [d.rank], {}) for d in infos], "take", combine=sum)
    assert [who for who, _ in t.sent] == ["r:0", "r:2"]
    with pytest.raises(DaemonGone, match="r:1 is gone; cannot call take"):
        await future


async def test_per_rank_arguments_are_combined_and_an_empty_group_answers_at_once() -> None:
    t = Table()
    future = t.table.send_each([(d, [d.rank], {}) for d in daemons(2)], "take", combine=sum)
    for who, m in t.sent:
        t.answer(who, m.call_id, m.args[0] * 10)
    assert await future == 10
    assert await t.table.send_all([], "ping", [], {}) == []


async def test_a_part_past_its_deadline_times_the_group_call_out_and_is_cancelled() -> None:
    t = Table(default_timeout_s=0.05)
    future = t.table.send_all(daemons(2), "sleep", [1], {})
    ids = [m.call_id for _, m in t.sent]
    t.answer("r:0", ids[0], 0)
    with pytest.raises(CallTimeout, match=r"r\[1\]\.sleep did not finish within 0.05s"):
        await future
    assert t.cancelled == [("r:1", ids[1])]


async def test_a_single_call_counts_the_bytes_of_counted_endpoints() -> None:
    t = Table()
    t.table.send(daemons(1)[0], "_dir", [{"a": 1}], {}, reply=False)
    t.table.send(daemons(1)[0], "ping", [], {}, reply=False)
    assert t.stats["dir"] == len(t.raw[0][0]) and t.stats["calls_sent"] == 2


async def test_a_reply_from_another_peer_is_dropped_not_taken() -> None:
    t = Table()
    [info] = daemons(1)
    future = t.table.send(info, "ping", [], {})
    [(_, msg)] = t.sent
    t.table.reply(b"r:7", Reply(msg.call_id, "forged", 0.0), 0.0)
    assert t.stats["dropped_replies"] == 1 and not future.done()
    t.answer("r:0", msg.call_id, "pong")
    assert await future == "pong"
    assert isinstance(Pending(None, info, "x", 0.0).where, str)


async def test_a_batch_shard_handle_names_its_owner_for_the_directory() -> None:
    t = Table()
    batch = BatchHandle((Shard("r:5", 1, {"x": TensorHandle("r:5", "k", (1,), "float32", "cpu", 4)}),))
    t.table.send_each([(d, [batch], {}) for d in daemons(2)], "take", combine=list)
    assert [who for who, _ in t.introduced] == ["r:0", "r:1"] and t.introduced[0][1] == [batch]
