"""The tensor plane with real daemons: handles, resharding across data-parallel sizes, every
transfer backend, freeing, dead owners and bad handles. The controller never carries the bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal

import pytest
import torch

from hfrt import RemoteError
from hfrt.deploy.launchers.base import DaemonSpec, expand
from hfrt.protocols import BatchHandle, TensorHandle
from tests.support import local_cluster

pytestmark = pytest.mark.timeout(120)


def probes(**sizes: int) -> list[DaemonSpec]:
    return [s for role, n in sizes.items() for s in expand(role, n, "probe")]


async def test_batches_move_by_handle_and_keep_every_column_type() -> None:
    async with local_cluster(probes(a=1, b=1)) as (ctl, _):
        a, b = await asyncio.gather(ctl.role("a"), ctl.role("b"))
        made = await a.make(list(range(10)), width=3)
        assert isinstance(made, BatchHandle) and len(made) == 10 and made.owners == ["a:0"]
        assert made.meta == {"width": 3}
        moved = await b.reshard(made)
        assert moved.owners == ["b:0"]
        fetched = await ctl.fetch(moved)  # on purpose: counted
        assert fetched["ids"].tolist() == list(range(10))
        assert fetched["x"].dtype == torch.float32 and fetched["x"].shape == (10, 3)
        assert fetched["half"].dtype == torch.bfloat16 and fetched["half"][:, 0].float().tolist() == list(range(10))
        assert fetched["odd"].dtype == torch.bool and fetched["odd"].tolist() == [i % 2 == 1 for i in range(10)]
        assert fetched["text"] == [f"row {i}" for i in range(10)]
        assert fetched.meta == {"width": 3}
        assert ctl.stats()["controller_bulk_bytes"] == fetched.nbytes
        stats = await ctl.daemon_stats("b")
        assert stats["b:0"]["pulled"]["shm"]["bytes"] == made.nbytes  # same host, CPU: shared memory


async def test_resharding_across_dp_sizes_keeps_row_order_without_a_full_gather() -> None:
    async with local_cluster(probes(one=1, two=2, three=3)) as (ctl, _):
        one, two, three = await asyncio.gather(ctl.role("one"), ctl.role("two"), ctl.role("three"))
        rows = list(range(64))
        batch = await two.make(rows)
        assert batch.owners == ["two:0", "two:1"] and len(batch) == 64
        for group, owners in ((three, ["three:0", "three:1", "three:2"]), (one, ["one:0"]), (two, ["two:0", "two:1"])):
            batch = await group.reshard(batch)
            assert batch.owners == owners
            seen = await group.inspect(batch)
            assert [r["id"] for r in seen] == rows and [r["x0"] for r in seen] == [float(r) for r in rows]
        stats = await ctl.daemon_stats("three")
        pulled = sorted(s["pulled"]["shm"]["bytes"] for s in stats.values())
        per_row = batch.nbytes // 64
        assert pulled == [21 * per_row, 21 * per_row, 22 * per_row]  # each rank pulled only its rows
        assert ctl.stats()["controller_bulk_bytes"] == 0


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
async def test_forced_backends_move_the_same_rows(backend: str) -> None:
    transfer = "dist" if backend == "gloo" else backend
    specs = probes(src=2) + [dataclasses.replace(s, options={"transfer": transfer}) for s in probes(dst=3)]
    async with local_cluster(specs) as (ctl, _):
        src, dst = await asyncio.gather(ctl.role("src"), ctl.role("dst"))
        if backend == "gloo":
            ranks = await ctl.form_data_plane("gloo")
            assert sorted(ranks.values()) == list(range(5))
        batch = await src.make(list(range(30)))
        seen = await dst.inspect(batch)
        assert [r["id"] for r in seen] == list(range(30))
        assert [r["rank"] for r in seen] == [0] * 10 + [1] * 10 + [2] * 10
        stats = await ctl.daemon_stats("dst")
        assert all(s["pulled"][transfer]["tensors"] > 0 and s["pulled"]["shm"]["tensors"] == 0 for s in stats.values())


async def test_own_outputs_are_used_in_place() -> None:
    async with local_cluster(probes(p=1)) as (ctl, _):
        p = await ctl.role("p")
        t = await p.tensor.call_one(0, 4096)
        assert isinstance(t, TensorHandle) and t.shape == (4, 256)
        assert await p.total.call_one(0, t) == float(sum(range(1024)))
        stats = await ctl.daemon_stats("p")
        assert stats["p:0"]["pulled"]["local"]["tensors"] == 1 and stats["p:0"]["pulled"]["shm"]["tensors"] == 0


async def test_dropped_handles_are_freed_and_memory_stays_flat() -> None:
    async with local_cluster(probes(a=2, b=1)) as (ctl, _):
        a, b = await asyncio.gather(ctl.role("a"), ctl.role("b"))
        for step in range(200):
            made = await a.make(list(range(16)))
            moved = await b.reshard(made)
            await a.inspect(moved)
            del made, moved
            if step in (10, 199):
                ctl.free_now()
                await asyncio.sleep(0.2)
                stats = await ctl.daemon_stats()
                assert all(s["store_tensors"] == 0 for s in stats.values()), stats
        assert ctl.stats()["keys_freed"] == 200 * (4 * 2 + 4)
        assert ctl.stats()["live_tensor_keys"] == 0


async def test_a_handle_whose_owner_died_fails_clearly() -> None:
    async with local_cluster(probes(a=1, b=1)) as (ctl, launcher):
        a, b = await asyncio.gather(ctl.role("a"), ctl.role("b"))
        batch = await a.make(list(range(4)))
        os.kill(launcher.processes["a:0"].pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        with pytest.raises(RemoteError, match=r"b\[0\].reshard raised TransferError: b:0 could not pull from a:0 via shm: a:0 \(pid \d+\) is gone"):
            await b.reshard(batch)
        assert await b.tensor.call_one(0, 8) is not None  # b keeps serving


async def test_bad_handles_get_clear_errors_and_the_daemon_keeps_serving() -> None:
    async with local_cluster(probes(a=1, b=1)) as (ctl, _):
        a, b = await asyncio.gather(ctl.role("a"), ctl.role("b"))
        good = await a.tensor.call_one(0, 4096)
        cases = {
            "unknown key": (dataclasses.replace(good, key="t999"), "holds no tensor 't999'"),
            "unknown owner": (dataclasses.replace(good, owner="ghost:0"), "no daemon named 'ghost:0'"),
            "wrong owner": (dataclasses.replace(good, owner="b:0"), "holds no tensor"),
            "dtype mismatch": (dataclasses.replace(good, dtype="int64"), "says int64\\[4, 256\\] but a:0 stores float32\\[4, 256\\]"),
            "shape mismatch": (dataclasses.replace(good, shape=(8, 128)), "says float32\\[8, 128\\]"),
        }
        for bad, message in cases.values():
            with pytest.raises(RemoteError, match=message):
                await b.total.call_one(0, bad)
        for bad, _ in cases.values():
            with pytest.raises(RemoteError, match="TransferError"):
                await b.timed_pull.call_one(0, bad, "zmq", 1)
        assert await b.total.call_one(0, good) == float(sum(range(1024)))
        del good
        gc.collect()


async def test_tensor_parallel_replicas_receive_the_same_rows() -> None:
    specs = probes(src=1) + [dataclasses.replace(s, dp_size=2) for s in probes(tp=4)]
    async with local_cluster(specs) as (ctl, _):
        src, tp = await asyncio.gather(ctl.role("src"), ctl.role("tp"))
        batch = await src.make(list(range(8)))
        collected = await tp.inspect(batch)  # split dispatch: one answer per data-parallel rank
        assert [r["id"] for r in collected] == list(range(8))
        assert [r["rank"] for r in collected] == [0] * 4 + [2] * 4
        assert await tp.last_seen.call() == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]


async def test_inline_batches_from_the_flow_split_across_ranks_without_owners() -> None:
    async with local_cluster(probes(p=2)) as (ctl, _):
        p = await ctl.role("p")
        rows = BatchHandle.inline({"ids_list": list(range(5)), "text": [f"q{i}" for i in range(5)]}, {"task": "t"})
        assert rows.owners == [""] and len(rows) == 5
        made = await p.make_from(rows)
        fetched = await ctl.fetch(made)
        assert fetched["ids"].tolist() == list(range(5)) and fetched.meta == {"width": 4}
        with pytest.raises(ValueError, match="differ in length"):
            BatchHandle.inline({"a": [1, 2], "b": [1]})
