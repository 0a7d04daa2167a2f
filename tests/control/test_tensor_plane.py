"""The controller's tensor plane through its own interface, without sockets or daemon processes:
what the peer directory holds and which daemon is told which entries, when, frees of dropped handles, fetch's
refusals and its count of bytes through the controller, per-daemon figures and forming the
data-plane group. A recording stand-in takes the place of the controller's submit."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from hfrt.control.daemons import DaemonInfo
from hfrt.control.tensor_plane import TensorPlane
from hfrt.protocols import BatchHandle, OutOfBand, Shard, TensorHandle
from hfrt.wire.errors import DaemonGone

pytestmark = pytest.mark.timeout(30)


def daemon(identity: str, *, alive: bool = True, data: str = "tcp://h:1") -> DaemonInfo:
    role, rank = identity.split(":")
    info = DaemonInfo(identity, role, int(rank), 2, int(rank), 2, 100 + int(rank), "host", "impl", {}, 0.0,
                      meta={"data": data, "host": "h1", "pid": 100 + int(rank)})
    info.alive = alive
    return info


class Sent:
    """Stands in for Controller.submit: records each call; answers from `answers` (endpoint → value)."""

    def __init__(self, answers: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, str, list[Any], bool, float | None]] = []
        self.answers = answers or {}

    def __call__(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                 timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]:
        self.calls.append((info.identity, endpoint, args, reply, timeout_s))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        answer = self.answers.get(endpoint)
        future.set_result(answer(info, args) if callable(answer) else answer)
        return future

    def to(self, endpoint: str) -> list[tuple[str, list[Any], bool]]:
        return [(who, args, reply) for who, ep, args, reply, _ in self.calls if ep == endpoint]


def plane(daemons: list[DaemonInfo], sent: Sent) -> tuple[TensorPlane, dict[str, int]]:
    registry = {d.identity: d for d in daemons}
    stats = {"controller_bulk_bytes": 0, "keys_freed": 0}
    return TensorPlane(registry.values, registry.get, sent, stats), stats


async def test_the_directory_lists_live_daemons_with_a_data_plane_before_any_group() -> None:
    daemons = [daemon("actor:0"), daemon("actor:1", alive=False), daemon("reward:0", data="")]
    tp, _ = plane(daemons, Sent())
    assert tp.directory.entries() == {"actor:0": {"data": "tcp://h:1", "host": "h1", "pid": 100, "plane_rank": -1}}


def shards(*owners: str) -> BatchHandle:
    return BatchHandle(tuple(Shard(o, 1, {"x": TensorHandle(o, f"k-{o}", (1,), "float32", "cpu", 4)}) for o in owners))


async def test_a_join_tells_nobody_and_a_call_first_tells_its_daemon_the_owners_it_lacks() -> None:
    daemons = [daemon("actor:0"), daemon("actor:1"), daemon("critic:0"), daemon("critic:1", alive=False)]
    sent = Sent()
    tp, _ = plane(daemons, sent)
    for d in daemons:
        tp.joined(d)
    assert sent.to("_hfrt_peers") == [], "a start-up sends no directory"
    inline = BatchHandle.inline({"prompt": ["a"]})
    tp.introduce(daemons[0], [shards("actor:0", "actor:1", "critic:1"), TensorHandle("critic:0", "k", (1,), "float32", "cpu", 4),
                              inline, shards("actor:1")])
    [(who, args, reply)] = sent.to("_hfrt_peers")
    assert who == "actor:0" and not reply, "one message, sent without a reply to wait for"
    assert args == [{"actor:1": tp.directory.entry(daemons[1]), "critic:1": tp.directory.entry(daemons[3]),
                     "critic:0": tp.directory.entry(daemons[2])}], "not itself nor inline rows; a gone owner's last entry"
    tp.introduce(daemons[0], [shards("actor:1", "critic:0", "critic:1")])
    assert len(sent.to("_hfrt_peers")) == 1, "what a daemon was told is not told again"
    assert tp.directory.told("actor:0") == {"actor:1", "critic:0", "critic:1"}


async def test_a_replaced_owner_is_told_anew_to_those_that_knew_it_and_the_newcomer_starts_empty() -> None:
    registry = {d.identity: d for d in (daemon("actor:0"), daemon("actor:1"), daemon("critic:0"))}
    sent = Sent()
    tp = TensorPlane(registry.values, registry.get, sent, {})
    tp.introduce(registry["actor:0"], [shards("actor:1")])
    tp.introduce(registry["actor:1"], [shards("critic:0")])
    fresh = registry["actor:1"] = daemon("actor:1", data="tcp://h:2")  # the roster now holds the new process
    tp.joined(fresh)
    update = sent.to("_hfrt_peers")[-1]
    assert update == ("actor:0", [{"actor:1": tp.directory.entry(fresh)}], False)
    assert update[1][0]["actor:1"]["data"] == "tcp://h:2"
    assert tp.directory.told("actor:1") == set(), "the new process was told nothing yet"
    tp.introduce(fresh, [shards("critic:0")])
    assert sent.to("_hfrt_peers")[-1][0] == "actor:1", "so it is told again when it needs to be"


async def test_the_directory_grows_with_the_owners_each_daemon_reads_not_with_all_pairs() -> None:
    n = 64
    daemons = [daemon(f"actor:{r}") for r in range(n)] + [daemon(f"critic:{r}") for r in range(n)]
    sent = Sent()
    tp, _ = plane(daemons, sent)
    rollout = shards(*(f"actor:{r}" for r in range(n)))
    for _step in range(3):  # each critic rank reads its own slice of the actor's rollout, every step
        for r in range(n):
            tp.introduce(daemons[n + r], [rollout.slice(r, r + 1)])
    entries = sum(len(args[0]) for _, args, _ in sent.to("_hfrt_peers"))
    assert entries == n, f"{entries} entries: one per critic rank, once"


async def test_forming_the_data_plane_opens_on_the_first_by_identity_joins_all_and_tells_everyone() -> None:
    daemons = [daemon("reward:0"), daemon("actor:1"), daemon("actor:0"), daemon("critic:0", alive=False)]
    sent = Sent({"_hfrt_plane_open": "tcp://master:5", "_hfrt_plane_join": None})
    tp, _ = plane(daemons, sent)
    ranks = await tp.form_data_plane("gloo", timeout_s=7.0)
    assert ranks == {"actor:0": 0, "actor:1": 1, "reward:0": 2}
    assert [(who, args) for who, args, _ in sent.to("_hfrt_plane_open")] == [("actor:0", [3])]
    joins = sorted((who, args) for who, args, _ in sent.to("_hfrt_plane_join"))
    assert joins == [("actor:0", ["tcp://master:5", 3, 0, "gloo"]), ("actor:1", ["tcp://master:5", 3, 1, "gloo"]),
                     ("reward:0", ["tcp://master:5", 3, 2, "gloo"])]
    assert all(t == 7.0 for _, ep, _, _, t in sent.calls if ep.startswith("_hfrt_plane"))
    assert sent.to("_hfrt_peers") == [], "a daemon told nothing is told nothing more"
    assert tp.directory.entries()["actor:1"]["plane_rank"] == 1


async def test_forming_tells_every_daemon_its_known_entries_again_with_their_ranks() -> None:
    daemons = [daemon("actor:0"), daemon("actor:1"), daemon("reward:0")]
    sent = Sent({"_hfrt_plane_open": "tcp://master:5", "_hfrt_plane_join": None})
    tp, _ = plane(daemons, sent)
    tp.introduce(daemons[2], [shards("actor:0", "actor:1")])
    await tp.form_data_plane("gloo")
    [_, (who, args, _)] = sent.to("_hfrt_peers")
    assert who == "reward:0" and {k: v["plane_rank"] for k, v in args[0].items()} == {"actor:0": 0, "actor:1": 1}


async def test_forming_with_no_live_daemon_is_refused() -> None:
    tp, _ = plane([daemon("actor:0", alive=False)], Sent())
    with pytest.raises(RuntimeError, match="no daemons to form a data plane with"):
        await tp.form_data_plane()


async def test_a_dropped_handle_is_freed_on_its_owner_on_the_next_loop_turn_and_counted() -> None:
    daemons = [daemon("actor:0"), daemon("actor:1", alive=False)]
    sent = Sent()
    tp, stats = plane(daemons, sent)
    tp.start(asyncio.get_running_loop())
    mine = TensorHandle("actor:0", "k1", (2,), "float32", "cpu", 8)
    gone = TensorHandle("actor:1", "k2", (2,), "float32", "cpu", 8)
    tp.track({"a": [mine], "b": gone})
    assert tp.live_keys == 2
    del mine, gone
    gc.collect()
    assert sent.to("_hfrt_free") == [], "frees wait for the next loop turn"
    await asyncio.sleep(0)
    assert sent.to("_hfrt_free") == [("actor:0", [["k1"]], False)], "a gone owner is not sent frees"
    assert stats["keys_freed"] == 1 and tp.live_keys == 0


async def test_fetch_refuses_an_unknown_owner_and_anything_but_a_handle() -> None:
    tp, _ = plane([daemon("actor:0")], Sent())
    with pytest.raises(DaemonGone, match="no daemon 'ghost:0' holds these tensors"):
        await tp.fetch(TensorHandle("ghost:0", "k", (1,), "float32", "cpu", 4))
    with pytest.raises(TypeError, match="fetch takes a TensorHandle or BatchHandle, not list"):
        await tp.fetch([1, 2])


async def test_fetch_counts_the_bytes_that_came_through_the_controller() -> None:
    data = bytes(range(16))
    sent = Sent({"_hfrt_fetch": [OutOfBand(data)]})
    tp, stats = plane([daemon("actor:0")], sent)
    tensor = await tp.fetch(TensorHandle("actor:0", "k", (4,), "int32", "cpu", 16))
    assert tensor.tolist() == [int.from_bytes(data[i:i + 4], "little") for i in range(0, 16, 4)]
    assert stats["controller_bulk_bytes"] == 16
    tp.count_bulk_bytes(4)
    assert stats["controller_bulk_bytes"] == 20


async def test_daemon_stats_asks_the_live_daemons_of_a_role_in_rank_order() -> None:
    daemons = [daemon("actor:1"), daemon("actor:0"), daemon("critic:0"), daemon("actor:2", alive=False)]
    sent = Sent({"_hfrt_stats": lambda info, _: {"store_tensors": info.rank}})
    tp, _ = plane(daemons, sent)
    assert await tp.daemon_stats("actor") == {"actor:0": {"store_tensors": 0}, "actor:1": {"store_tensors": 1}}
    assert set(await tp.daemon_stats()) == {"actor:0", "actor:1", "critic:0"}
