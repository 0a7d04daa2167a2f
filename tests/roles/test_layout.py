"""roles/training/parallel/layout.py: training coordinates, the micro-DP grouping of a generation layout over
a training one, and the nesting of every rank's shards (pure logic, no processes)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel.stages import stage_of
from hfrt.roles.training.parallel.tp_plan import chunk_bounds


@dataclass(frozen=True)
class Shape:
    """The sizes of a synthetic Llama-shaped parameter set (no model is built)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


#: 4 heads, 4 kv heads, 4 layers so pp=4 and tp=4 fit; a vocabulary every tp here divides
SHAPE = Shape(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=16, vocab_size=256)
#: what transformers' Llama plan splits (the embedding stays whole; the head only when tp divides the vocabulary)
_DIMS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "lm_head": 0, "o_proj": 1, "down_proj": 1}


def config(model: Shape) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.num_heads * model.head_dim, intermediate_size=128,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads,
    )  # fmt: skip


def params(model: Shape, hidden: int = 64, inter: int = 128) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (model.vocab_size, hidden)}
    kv = model.num_kv_heads * model.head_dim
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
        }
    out |= {"model.norm.weight": (hidden,), "lm_head.weight": (model.vocab_size, hidden)}
    return out


def dims(model: Shape, tp: int) -> dict[str, int | None]:
    """Split dims at `tp` as tp_plan.split_dims reports them for this parameter set."""
    out: dict[str, int | None] = {}
    for name in params(model):
        dim = _DIMS.get(name.split(".")[-2])
        if tp == 1 or (name.startswith("lm_head") and model.vocab_size % tp):
            dim = None
        out[name] = dim
    return out


def layouts(world: int) -> list[L.Layout]:
    return [L.Layout(t, p, world // (t * p)) for t in (1, 2, 4) for p in (1, 2, 4) if world % (t * p) == 0]


def nesting_pairs(world: int = 4) -> list[tuple[L.Layout, L.Layout]]:
    pairs = []
    cfg = config(SHAPE)
    for a, b in itertools.product(layouts(world), layouts(world)):
        try:
            L.check_pair(a, b, cfg)
        except ValueError:
            continue
        pairs.append((a, b))
    return pairs


PAIRS = nesting_pairs(4) + nesting_pairs(8)


def rows(name: str, shape: tuple[int, ...], layout: L.Layout, c: L.Coords) -> set[tuple[int, ...]] | None:
    """The (dim, index) slices a rank holds of one parameter along its split dim (DTensor's chunk
    rule); None if its stage does not hold the parameter."""
    if c.pp not in stage_of(name, SHAPE.num_layers, layout.pp):
        return None
    dim = dims(SHAPE, layout.tp)[name]
    if dim is None:  # whole: every index along the dim it would be split on
        axis = _DIMS.get(name.split(".")[-2]) or 0
        return {(axis, i) for i in range(shape[axis])}
    return {(dim, i) for i in range(*chunk_bounds(shape[dim], layout.tp, c.tp))}


def test_parse_and_format() -> None:
    assert L.Layout.parse("t2p1d2") == L.Layout(2, 1, 2)
    assert str(L.Layout(4, 2, 1)) == "t4p2d1"
    assert L.Layout.for_world(8, tp=2) == L.Layout(2, 1, 4)
    with pytest.raises(ValueError, match="t<tp>p<pp>d<dp>"):
        L.Layout.parse("tp2")
    with pytest.raises(ValueError, match="does not divide world_size=4"):
        L.Layout.for_world(4, tp=3)
    with pytest.raises(ValueError, match="needs 8 ranks, the role has 4"):
        L.Layout(2, 2, 2).check(4)
    with pytest.raises(ValueError, match="tp=3 does not divide the model's 4 attention heads"):
        L.Layout(3, 1, 1).check(3, config(SHAPE))
    with pytest.raises(ValueError, match="pp=5 must be between 1 and the model's 4 layers"):
        L.Layout(1, 5, 1).check(5, config(SHAPE))


def test_train_coords_order_and_inverse() -> None:
    lay = L.Layout(2, 2, 2)
    assert [L.train_coords(lay, r) for r in (0, 1, 2, 5)] == [
        L.Coords(0, 0, 0), L.Coords(0, 0, 1), L.Coords(0, 1, 0), L.Coords(1, 0, 1)
    ]
    assert all(L.rank_of(lay, L.train_coords(lay, r)) == r for r in range(8))


def test_mixed_nesting_is_refused() -> None:
    with pytest.raises(ValueError, match="does not nest"):
        L.check_pair(L.Layout(2, 1, 2), L.Layout(1, 2, 2))
    with pytest.raises(ValueError, match="has 2 ranks"):
        L.check_pair(L.Layout(2, 1, 2), L.Layout(2, 1, 1))


def test_paper_figure_8_grouping() -> None:
    """t=4 → t_g=2: micro-DP groups are neighbours {0,1},{2,3}; generation TP groups strided."""
    train, gen = L.Layout(4, 1, 1), L.Layout(2, 1, 2)
    assert L.micro_dp_groups(train, gen) == [[0, 1], [2, 3]]
    assert L.gen_tp_groups(train, gen) == [[0, 2], [1, 3]]
    assert [L.gen_coords(train, gen, r)[0].tp for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_groups_partition_and_shards_nest(train: L.Layout, gen: L.Layout) -> None:
    world = train.world
    cs = L.all_gen_coords(train, gen)
    assert sorted((c.pp, c.dp, c.tp) for c in cs) == sorted(
        itertools.product(range(gen.pp), range(gen.dp), range(gen.tp))
    ), "generation coordinates are a bijection onto the generation layout"
    m = L.micro_dp_size(train, gen)
    for groups, size in (
        (L.micro_dp_groups(train, gen), m),
        (L.gen_tp_groups(train, gen), gen.tp),
        (L.gen_pp_groups(train, gen), gen.pp),
        (L.gen_dp_groups(train, gen), gen.mp),
        (L.train_dp_groups(train), train.dp),
        (L.train_mp_groups(train), train.mp),
        (L.train_tp_groups(train), train.tp),
    ):
        assert sorted(r for g in groups for r in g) == list(range(world)), "groups partition the world"
        assert all(len(g) == size for g in groups)
    for group in L.gen_tp_groups(train, gen):
        assert [cs[r].tp for r in group] == list(range(gen.tp))
    shapes = params(SHAPE)
    for rank in range(world):
        t_c, g_c = L.train_coords(train, rank), cs[rank]
        for name, shape in shapes.items():
            mine, want = rows(name, shape, train, t_c), rows(name, shape, gen, g_c)
            if train.mp >= gen.mp:  # merging: the training shard is part of the generation shard
                assert mine is None or want is not None, f"rank {rank} {name}: held in training, not in generation"
                if mine is not None and want is not None:
                    assert mine <= want, f"rank {rank} {name}: training piece outside generation piece"
            else:  # slicing: the generation shard is part of the training shard
                assert want is None or mine is not None, f"rank {rank} {name}"
                if want is not None and mine is not None:
                    assert want <= mine, f"rank {rank} {name}: generation piece outside training piece"


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_micro_dp_group_covers_its_generation_shard(train: L.Layout, gen: L.Layout) -> None:
    """The union of a micro-DP group's training pieces is exactly its generation piece (so no rank
    outside the group is ever needed, and nothing beyond the generation shard is gathered)."""
    cs = L.all_gen_coords(train, gen)
    for group in L.micro_dp_groups(train, gen):
        g = cs[group[0]]
        assert all((cs[r].pp, cs[r].tp) == (g.pp, g.tp) for r in group), "a micro-DP group shares one shard"
        for name, shape in params(SHAPE).items():
            want = rows(name, shape, gen, g)
            held = [rows(name, shape, train, L.train_coords(train, r)) for r in group]
            union = set().union(*(h for h in held if h is not None))
            if want is None:
                continue
            if train.mp >= gen.mp:
                assert union == want, f"{train}->{gen} group {group} {name}"
            else:
                assert want <= union, f"{train}->{gen} group {group} {name}"
