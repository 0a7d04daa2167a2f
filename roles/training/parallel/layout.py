"""Parallel layouts (tp, pp, dp) of one role, and how a generation layout is laid over a training one.

A training layout puts rank r at (pp, dp, tp) coordinates (`train_coords`, the one function that
knows the rank order). The generation layout of the same ranks follows the 3D-HybridEngine's
grouping (HybridFlow §5, Fig. 8): inside each training model-parallel group of t·p ranks,
micro-DP groups of m = (t·p)/(t_g·p_g) *neighbouring* ranks share one generation shard, and the
generation TP groups are strided across them, so every rank's training shard is part of its
generation shard and gathering happens only inside a micro-DP group. When the generation layout
is the more sharded one (t_g·p_g > t·p), each rank slices its generation shard out of its training
shard. Pure arithmetic on ranks: it knows no process groups beyond `new_groups`, no tensors, no
engines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_TEXT = re.compile(r"^t(\d+)p(\d+)d(\d+)(?:v(\d+))?$")


@dataclass(frozen=True, slots=True)
class Coords:
    """One rank's place in a layout: pipeline stage, data-parallel replica, tensor-parallel rank."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True, slots=True)
class Layout:
    """tp × pp model parallelism replicated dp times; world size tp·pp·dp. `vpp`: pipeline
    stages per pp rank (interleaved schedules; which rank holds which layer, see stages.py)."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {self.tp, self.pp, self.dp}: {name} must be >= 1")

    @staticmethod
    def parse(text: str) -> Layout:
        """'t2p1d2' → Layout(tp=2, pp=1, dp=2); 't1p2d1v2': 2 stages per pipeline rank."""
        match = _TEXT.match(text.strip())
        if not match:
            raise ValueError(f"layout {text!r}: expected 't<tp>p<pp>d<dp>' (optionally 'v<stages per rank>'), e.g. 't2p1d2'")
        tp, pp, dp = (int(g) for g in match.groups()[:3])
        return Layout(tp, pp, dp, int(match.group(4) or 1))

    @staticmethod
    def for_world(world: int, tp: int = 1, pp: int = 1, where: str = "parallel", vpp: int = 1) -> Layout:
        """The layout with dp following from the world size; ValueError if tp·pp does not divide it."""
        if tp < 1 or pp < 1 or world % (tp * pp):
            raise ValueError(f"{where}: tp={tp} × pp={pp} does not divide world_size={world}")
        return Layout(tp, pp, world // (tp * pp), vpp)

    def __str__(self) -> str:
        return f"t{self.tp}p{self.pp}d{self.dp}" + (f"v{self.vpp}" if self.vpp > 1 else "")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def mp(self) -> int:
        """Model-parallel group size: ranks that together hold one copy of the model."""
        return self.tp * self.pp

    def check(self, world: int, config: Any = None, where: str = "parallel") -> None:
        """Raise ValueError naming what does not fit: the world size, or (given a transformers
        config) the model's heads, kv heads, intermediate size or layers (tp_plan.check_tp)."""
        if self.world != world:
            raise ValueError(f"{where}: layout {self} needs {self.world} ranks, the role has {world}")
        if config is not None:
            from hfrt.roles.training.parallel.stages import check_pp
            from hfrt.roles.training.parallel.tp_plan import check_tp, text_config

            check_tp(config, self.tp, where)
            check_pp(int(text_config(config).num_hidden_layers), self.pp, where, self.vpp)


def train_coords(layout: Layout, rank: int) -> Coords:
    """The training (pp, dp, tp) of `rank`: rank = (pp·dp_size + dp)·tp_size + tp (tp fastest)."""
    if not 0 <= rank < layout.world:
        raise ValueError(f"rank {rank} is outside layout {layout} ({layout.world} ranks)")
    tp = rank % layout.tp
    dp = (rank // layout.tp) % layout.dp
    pp = rank // (layout.tp * layout.dp)
    return Coords(pp, dp, tp)


def rank_of(layout: Layout, c: Coords) -> int:
    """Inverse of train_coords."""
    return (c.pp * layout.dp + c.dp) * layout.tp + c.tp


def check_pair(train: Layout, gen: Layout, config: Any = None) -> None:
    """Raise ValueError unless `gen` can be laid over `train` by micro-DP grouping: the same ranks,
    and generation shards that nest with training shards in both tp and pp."""
    if train.world != gen.world:
        raise ValueError(f"generation layout {gen} has {gen.world} ranks, training layout {train} has {train.world}")
    merging = train.tp % gen.tp == 0 and train.pp % gen.pp == 0
    slicing = gen.tp % train.tp == 0 and gen.pp % train.pp == 0
    if not (merging or slicing):
        raise ValueError(
            f"generation layout {gen} does not nest with training layout {train}: need tp_g | tp and pp_g | pp "
            f"(generation merges training shards) or tp | tp_g and pp | pp_g (generation slices them)"
        )
    if config is not None:
        train.check(train.world, config, "training parallel")
        gen.check(gen.world, config, "generation parallel")


def micro_dp_size(train: Layout, gen: Layout) -> int:
    """m = (t·p)/(t_g·p_g) when generation merges training shards, else 1 (it slices them)."""
    return max(1, train.mp // gen.mp)


def gen_coords(train: Layout, gen: Layout, rank: int) -> tuple[Coords, int]:
    """The generation (pp, dp, tp) of `rank` and its rank inside its micro-DP group.

    Merging (t_g | t, p_g | p): a training tp rank keeps tp_g = tp // (t/t_g) — its neighbours
    tp .. tp+t/t_g-1 hold the rest of its generation shard — and likewise pp_g = pp // (p/p_g); the
    micro-DP rank counts those neighbours and becomes part of the generation dp index.
    Slicing (t | t_g, p | p_g): r = (t_g·p_g)/(t·p) training replicas form one generation group;
    replica j takes the j-th slice of its training shard.
    """
    check_pair(train, gen)
    c = train_coords(train, rank)
    if train.mp >= gen.mp:
        ft, fp = train.tp // gen.tp, train.pp // gen.pp
        micro = (c.pp % fp) * ft + c.tp % ft
        return Coords(c.pp // fp, c.dp * ft * fp + micro, c.tp // ft), micro
    st, sp = gen.tp // train.tp, gen.pp // train.pp
    j = c.dp % (st * sp)
    return Coords(c.pp * sp + j // st, c.dp // (st * sp), c.tp * st + j % st), 0


def all_gen_coords(train: Layout, gen: Layout) -> list[Coords]:
    return [gen_coords(train, gen, r)[0] for r in range(train.world)]


def _groups(keys: list[tuple[Any, ...]], order: list[int]) -> list[list[int]]:
    """Ranks grouped by equal key, each group sorted by `order`, groups sorted by first key."""
    by: dict[tuple[Any, ...], list[int]] = {}
    for rank, key in enumerate(keys):
        by.setdefault(key, []).append(rank)
    return [sorted(ranks, key=lambda r: order[r]) for _, ranks in sorted(by.items())]


def gen_tp_groups(train: Layout, gen: Layout) -> list[list[int]]:
    """The generation TP groups (ranks ordered by generation tp rank)."""
    cs = all_gen_coords(train, gen)
    return _groups([(c.dp, c.pp) for c in cs], [c.tp for c in cs])


def gen_pp_groups(train: Layout, gen: Layout) -> list[list[int]]:
    """The generation pipeline groups (ranks ordered by generation stage)."""
    cs = all_gen_coords(train, gen)
    return _groups([(c.dp, c.tp) for c in cs], [c.pp for c in cs])


def gen_dp_groups(train: Layout, gen: Layout) -> list[list[int]]:
    """The generation model-parallel groups, one per generation dp index (ranks by (pp, tp))."""
    cs = all_gen_coords(train, gen)
    return _groups([(c.dp,) for c in cs], [c.pp * gen.tp + c.tp for c in cs])


def micro_dp_groups(train: Layout, gen: Layout) -> list[list[int]]:
    """The micro-DP groups: ranks of one training replica that share one generation shard, ordered
    by micro-DP rank; singletons when generation slices (no gathering at all)."""
    keys, order = [], []
    for rank in range(train.world):
        g, micro = gen_coords(train, gen, rank)
        keys.append((train_coords(train, rank).dp, g.pp, g.tp))
        order.append(micro)
    return _groups(keys, order)


def train_tp_groups(layout: Layout) -> list[list[int]]:
    cs = [train_coords(layout, r) for r in range(layout.world)]
    return _groups([(c.pp, c.dp) for c in cs], [c.tp for c in cs])


def train_dp_groups(layout: Layout) -> list[list[int]]:
    """Ranks holding the same training shard (FSDP's gather group), ordered by dp rank."""
    cs = [train_coords(layout, r) for r in range(layout.world)]
    return _groups([(c.pp, c.tp) for c in cs], [c.dp for c in cs])


def train_mp_groups(layout: Layout) -> list[list[int]]:
    """Ranks holding one copy of the model in training, ordered by (pp, tp)."""
    cs = [train_coords(layout, r) for r in range(layout.world)]
    return _groups([(c.dp,) for c in cs], [c.pp * layout.tp + c.tp for c in cs])


def dp_axes(train: Layout, gen: Layout, rank: int) -> dict[str, list[int]]:
    """`rank`'s data-parallel coordinates as a daemon declares them in its hello (hfrt.control.dispatch):
    "dp" by the training layout (ranks of one tp/pp group share rows), "generation" by the
    generation layout (ranks of one generation tp/pp group share rows)."""
    g, _ = gen_coords(train, gen, rank)
    return {"dp": [train_coords(train, rank).dp, train.dp], "generation": [g.dp, gen.dp]}


@dataclass(frozen=True, slots=True)
class RankGroups:
    """This rank's torch.distributed groups for a (train, gen) pair and their rank lists."""

    gen_tp: Any
    gen_tp_ranks: list[int]
    micro_dp: Any
    micro_dp_ranks: list[int]
    train_mp: Any
    train_mp_ranks: list[int]
    train_dp: Any
    train_dp_ranks: list[int]


def new_groups(train: Layout, gen: Layout, rank: int) -> RankGroups:
    """Create every process group of the pair (a collective: all ranks call this with the same
    layouts, in the same order) and return the ones `rank` belongs to. Groups of one rank are None."""
    import torch.distributed as dist

    mine: dict[str, tuple[Any, list[int]]] = {}
    for name, groups in (
        ("gen_tp", gen_tp_groups(train, gen)),
        ("micro_dp", micro_dp_groups(train, gen)),
        ("train_mp", train_mp_groups(train)),
        ("train_dp", train_dp_groups(train)),
    ):
        for ranks in groups:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[name] = (pg, ranks)
    return RankGroups(*mine["gen_tp"], *mine["micro_dp"], *mine["train_mp"], *mine["train_dp"])
