"""Dispatch and collect rules, and endpoint declarations."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hfrt.control.dispatch import RankSlot, collect, dispatch
from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.wire.endpoints import Dispatch, chunk_bounds, endpoint, endpoint_table


@given(st.integers(0, 200), st.integers(1, 9))
def test_chunk_bounds_cover_every_row_once_in_order(n: int, parts: int) -> None:
    bounds = chunk_bounds(n, parts)
    assert len(bounds) == parts
    assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(n))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def slots(world: int, dp: int) -> list[RankSlot]:
    return [RankSlot(r, r * dp // world, dp) for r in range(world)]


def test_split_gives_tensor_parallel_replicas_the_same_rows() -> None:
    plan = dispatch(Dispatch.SPLIT, "f", slots(4, 2), [list(range(6)), "same"], {"ids": list("abcdef")})
    assert [(s.rank, a, kw) for s, a, kw in plan] == [
        (0, [[0, 1, 2], "same"], {"ids": ["a", "b", "c"]}),
        (1, [[0, 1, 2], "same"], {"ids": ["a", "b", "c"]}),
        (2, [[3, 4, 5], "same"], {"ids": ["d", "e", "f"]}),
        (3, [[3, 4, 5], "same"], {"ids": ["d", "e", "f"]}),
    ]
    results = [[f"r{s.rank}-{x}" for x in a[0]] for s, a, _ in plan]
    assert collect(Dispatch.SPLIT, [s for s, _, _ in plan], results) == [
        "r0-0", "r0-1", "r0-2", "r2-3", "r2-4", "r2-5"
    ]


def test_split_refuses_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="arg0=3, ids=2"):
        dispatch(Dispatch.SPLIT, "f", slots(2, 2), [[1, 2, 3]], {"ids": [1, 2]})


def test_replicate_and_rank0() -> None:
    s = slots(3, 3)
    assert [a for _, a, _ in dispatch(Dispatch.REPLICATE, "f", s, [1], {})] == [[1], [1], [1]]
    assert [x.rank for x, _, _ in dispatch(Dispatch.RANK0, "f", s, [1], {})] == [0]
    assert collect(Dispatch.REPLICATE, s, [1, 2, 3]) == [1, 2, 3]
    assert collect(Dispatch.RANK0, s[:1], [7]) == 7


class Sample(Daemon):
    @endpoint(dispatch=Dispatch.SPLIT)
    def rows(self, xs: list[int], scale: int = 1) -> list[int]:
        return [x * scale for x in xs]

    @endpoint(concurrent=True, name="wire_name")
    async def fancy(self, *args: int, **kwargs: int) -> int:
        return len(args) + len(kwargs)


def test_endpoint_table_is_declared_on_the_class() -> None:
    table = endpoint_table(Sample)
    assert set(table) == {"describe", "rows", "wire_name"}
    rows, fancy = table["rows"][0], table["wire_name"][0]
    assert rows.dispatch is Dispatch.SPLIT and not rows.concurrent and not rows.is_async
    assert fancy.concurrent and fancy.is_async
    assert rows.positional_range == (1, 2) and fancy.positional_range is None


def test_argument_check_matches_python_binding() -> None:
    spec = endpoint_table(Sample)["rows"][0]
    spec.accepts([[1]], {})
    spec.accepts([[1]], {"scale": 2})
    with pytest.raises(TypeError):
        spec.accepts([], {})
    with pytest.raises(TypeError):
        spec.accepts([[1], 2, 3], {})
    with pytest.raises(TypeError):
        spec.accepts([[1]], {"nope": 1})


def test_context_derives_data_parallel_coordinates() -> None:
    ctx = DaemonContext("actor", rank=3, world_size=4, dp_size=2)
    assert (ctx.dp_rank, ctx.dp_size, ctx.identity) == (1, 2, "actor:3")
    with pytest.raises(ValueError, match="outside world_size"):
        DaemonContext("actor", rank=4, world_size=4)
    with pytest.raises(ValueError, match="do not fit"):
        DaemonContext("actor", rank=0, world_size=4, dp_size=3)


# ---- 3D dispatch: training rows by training dp, generation rows by generation dp (3D_PROTO)


def layout_slots(train: str, gen: str) -> list[RankSlot]:
    from hfrt.roles.training.parallel.layout import Layout, dp_axes

    t, g = Layout.parse(train), Layout.parse(gen)
    return [RankSlot.of(r, 0, 1, {"dp_axes": dp_axes(t, g, r)}) for r in range(t.world)]


def test_split_generation_follows_the_generation_layout() -> None:
    """t4p1d1 → t2p1d2: training is one tp group (every rank the same rows); generation TP groups
    are strided ({0, 2}, {1, 3}), so those pairs share rows and one of each answers."""
    s = layout_slots("t4p1d1", "t2p1d2")
    assert [a for _, a, _ in dispatch(Dispatch.SPLIT, "update", s, [[1, 2, 3, 4]], {})] == [[[1, 2, 3, 4]]] * 4
    plan = dispatch(Dispatch.SPLIT_GENERATION, "generate", s, [["p0", "p1", "p2", "p3"]], {})
    assert [a[0] for _, a, _ in plan] == [["p0", "p1"], ["p2", "p3"], ["p0", "p1"], ["p2", "p3"]]
    replies = [[f"r{slot.rank}:{p}" for p in a[0]] for slot, a, _ in plan]
    assert collect(Dispatch.SPLIT_GENERATION, [x for x, _, _ in plan], replies) == ["r0:p0", "r0:p1", "r1:p2", "r1:p3"]


def test_split_generation_at_lower_tp_than_training() -> None:
    """t2p1d2 → t1p1d4: training pairs {0,1}, {2,3} share rows; generation gives every rank its own."""
    s = layout_slots("t2p1d2", "t1p1d4")
    rows = list(range(8))
    assert [a[0] for _, a, _ in dispatch(Dispatch.SPLIT, "update", s, [rows], {})] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    plan = dispatch(Dispatch.SPLIT_GENERATION, "generate", s, [rows], {})
    assert [a[0] for _, a, _ in plan] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert collect(Dispatch.SPLIT_GENERATION, [x for x, _, _ in plan], [a[0] for _, a, _ in plan]) == rows


def test_split_generation_without_axes_is_split() -> None:
    s = slots(4, 2)
    assert dispatch(Dispatch.SPLIT_GENERATION, "g", s, [[1, 2]], {}) == dispatch(Dispatch.SPLIT, "g", s, [[1, 2]], {})


def test_rank_slot_from_hello_meta() -> None:
    slot = RankSlot.of(3, 3, 4, {"dp_axes": {"dp": [1, 2], "generation": [3, 4]}})
    assert (slot.dp_rank, slot.dp_size, slot.coord("generation"), slot.coord("other")) == (1, 2, (3, 4), (1, 2))
    assert RankSlot.of(1, 1, 2, {"data": "tcp://x"}) == RankSlot(1, 1, 2)
    with pytest.raises(ValueError, match=r"rank 2: dp_axes\['generation'\] = \[2, 2\]"):
        RankSlot.of(2, 0, 1, {"dp_axes": {"generation": [2, 2]}})
    with pytest.raises(ValueError, match="disagree on the size of data-parallel axis 'generation'"):
        bad = [RankSlot(0, 0, 1, (("generation", 0, 2),)), RankSlot(1, 0, 1, (("generation", 0, 3),))]
        dispatch(Dispatch.SPLIT_GENERATION, "g", bad, [[1, 2]], {})
