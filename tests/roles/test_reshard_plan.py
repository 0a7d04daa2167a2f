"""roles/training/parallel/reshard_plan.py's exchange plans (pure logic): who sends which rows,
never more than a generation shard, nothing for equal layouts, and the fallback for pieces that do
not nest."""

from __future__ import annotations

import pytest

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel.reshard_plan import Params, fallback_names, make_plan
from tests.roles.test_layout import PAIRS, SHAPE, Shape, dims, params

#: a vocabulary of 258 rows: split 129+129 at tp=2, whole at tp=4 (which does not divide it)
UNEVEN = Shape(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=16, vocab_size=258)


def spec(model: Shape, train: L.Layout, gen: L.Layout) -> Params:
    return Params(params(model), dims(model, train.tp), dims(model, gen.tp), model.num_layers)


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_a_group_sends_each_wanted_row_once(train: L.Layout, gen: L.Layout) -> None:
    p = spec(SHAPE, train, gen)
    for rank in range(train.world):
        plan = make_plan(train, gen, rank, p)
        sent: dict[str, list[tuple[int, int]]] = {}
        for block in plan.blocks.values():
            for member in block:
                for s in member:
                    sent.setdefault(s.name, []).append((s.start, s.stop))
        for name, rows in sent.items():
            lo, hi = plan.want[name]
            assert all(lo <= a < b <= hi for a, b in rows), f"{name}: rows outside the generation shard"
            assert sum(b - a for a, b in rows) <= hi - lo, f"{name}: a row sent twice"
        if train == gen or L.micro_dp_size(train, gen) == 1:
            assert not plan.blocks, "no micro-DP group, yet something is sent"


def test_fallback_only_for_pieces_that_do_not_nest() -> None:
    t2, t4, t1 = L.Layout(2, 1, 2), L.Layout(4, 1, 1), L.Layout(1, 1, 4)
    assert fallback_names(t2, t4, 0, spec(UNEVEN, t2, t4)) == {"lm_head.weight"}  # 129+129 vs whole
    assert fallback_names(t4, t2, 0, spec(UNEVEN, t4, t2)) == set()  # whole at tp=4 covers 129+129
    assert fallback_names(t2, t1, 0, spec(UNEVEN, t2, t1)) == set()
    assert all(not fallback_names(a, b, r, spec(SHAPE, a, b)) for a, b in PAIRS for r in range(a.world))


def test_split_dims_must_agree() -> None:
    shapes = {"w": (4, 4)}
    with pytest.raises(ValueError, match="w: split along dim 0 for training but dim 1 for generation"):
        Params(shapes, {"w": 0}, {"w": 1}, 1)
