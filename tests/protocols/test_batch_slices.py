"""Slicing a batch handle: the same rows as walking every shard, found by bisection, so cutting a
batch of N shards into N data-parallel parts stays O(N log N) (the scale benchmark's dispatch);
a shard the slice takes whole is reused, not narrowed."""

from __future__ import annotations

import time
import weakref

from hypothesis import given
from hypothesis import strategies as st

from hfrt.protocols import BatchHandle, Shard, TensorHandle, Wire, new_key


def batch(rows: list[int]) -> BatchHandle:
    return BatchHandle(tuple(Shard(f"r:{i}", n, {"x": TensorHandle(f"r:{i}", f"k{i}", (n, 2), "float32", "cpu", 8 * n)})
                             for i, n in enumerate(rows)))


def walked(handle: BatchHandle, start: int, stop: int) -> list[tuple[str, int, tuple[int, int] | None]]:
    """What a slice must hold, by walking every shard: (owner, rows, the column's row range)."""
    out, offset = [], 0
    for shard in handle.shards:
        lo, hi = max(start - offset, 0), min(stop - offset, shard.rows)
        if lo < hi:
            out.append((shard.owner, hi - lo, (lo, hi)))
        offset += shard.rows
    return out


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.data())
def test_a_slice_holds_the_rows_a_walk_over_every_shard_finds(rows: list[int], data: st.DataObject) -> None:
    handle = batch(rows)
    assert len(handle) == sum(rows)
    start = data.draw(st.integers(0, len(handle)))
    stop = data.draw(st.integers(start, len(handle)))
    part = handle.slice(start, stop)
    assert [(s.owner, s.rows, s.columns["x"].row_range) for s in part.shards] == walked(handle, start, stop)
    whole = {id(s) for s in handle.shards}
    assert all((id(s) in whole) == (s.rows == orig) for s in part.shards for orig in [handle.shards[int(s.owner[2:])].rows]), \
        "a shard taken whole is the shard itself, a part of one is narrowed"
    assert len(part) == stop - start


def test_cutting_a_4096_shard_batch_into_4096_parts_is_not_quadratic() -> None:
    handle = batch([2] * 4096)
    start = time.perf_counter()
    parts = [handle.slice(2 * i, 2 * i + 2) for i in range(4096)]
    took = time.perf_counter() - start
    assert [p.shards[0].owner for p in parts[:3]] == ["r:0", "r:1", "r:2"] and all(len(p) == 2 for p in parts)
    assert took < 1.0, f"{took:.2f}s to cut 4096 parts (walking every shard per part takes seconds)"


def test_a_slice_that_is_one_whole_shard_is_a_full_handle() -> None:
    """The fast path (no dataclass constructor) makes the same handle the constructor does: equal,
    its own length and row ends, sliceable again, weakly referable, and the same on the wire."""
    handle = BatchHandle(batch([3, 4, 5]).shards, {"step": 7})
    part = handle.slice(3, 7)
    made = BatchHandle((handle.shards[1],), {"step": 7})
    assert part == made and part.shards[0] is handle.shards[1] and part.parents == (handle,)
    assert len(part) == 4 and part._ends == made._ends == (4,)
    assert part.slice(1, 3).shards[0].columns["x"].row_range == (1, 3)
    assert weakref.ref(part)() is part and part.meta == {"step": 7} and part.meta is not handle.meta
    wire = Wire(new_key())
    twice = [wire.unpack(wire.pack_calls((1,), "take", [h], {})[0]).args[0] for h in (part, part)]  # second: kept wire form
    assert twice[0] == twice[1] == made
