"""roles/training/parallel/reshard_plan.py's exchange plans (pure logic): who sends which rows, never more than
a generation shard, nothing for equal layouts, and the fallback for uneven splits that do not nest."""

from __future__ import annotations

import pytest

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel.reshard_plan import fallback_names, make_plan
from hfrt.roles.training.parallel.shard import ModelShape
from tests.roles.test_layout import PAIRS, SHAPE, params

UNEVEN = ModelShape(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=10)


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_a_group_sends_each_wanted_row_once(train: L.Layout, gen: L.Layout) -> None:
    shapes = params(SHAPE)
    for rank in range(train.world):
        plan = make_plan(train, gen, rank, shapes, SHAPE)
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


def test_fallback_only_for_splits_that_do_not_nest() -> None:
    shapes = params(UNEVEN)
    vocab = {"model.embed_tokens.weight", "lm_head.weight"}
    assert fallback_names(L.Layout(4, 1, 1), L.Layout(2, 1, 2), 0, shapes, UNEVEN) == vocab  # 3+3|2+2 vs 5+5
    assert fallback_names(L.Layout(2, 1, 2), L.Layout(1, 1, 4), 0, shapes, UNEVEN) == set()
    assert all(not fallback_names(a, b, r, params(SHAPE), SHAPE) for a, b in PAIRS for r in range(a.world))
