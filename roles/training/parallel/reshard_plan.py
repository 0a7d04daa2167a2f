"""The exchange plan of a 3D-HybridEngine transition: from two layouts and the full parameter
shapes, which member of a micro-DP group sends which rows of which parameter, so no sizes travel.

A micro-DP group's training pieces cover exactly its generation piece (layout.py), so gathered
bytes never exceed one generation shard. The one exception is an uneven split whose bounds do not
nest (a vocabulary of 10 rows is 3+3+2+2 at tp=4 but 5+5 at tp=2): those parameters alone are
planned over the training model-parallel group (`fallback_names`). Pure logic: it knows parameter
names and shapes, and nothing of tensors, collectives or engines (exchange.py runs a plan).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel.shard import ModelShape, holds, layer_of, split_kind, tp_piece

Interval = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows [start, stop) of parameter `name` along its split dim (full-tensor coordinates)."""

    name: str
    start: int
    stop: int


def split_dim(name: str) -> int:
    """The dim a parameter is cut along (row-parallel: 1; everything else: 0, whole when replicated)."""
    return 1 if split_kind(name) == "row" else 0


def interval(name: str, shape: tuple[int, ...], tp: int, tp_rank: int, model: ModelShape) -> Interval:
    piece = tp_piece(name, shape, tp, tp_rank, model)
    if piece.dim is None:
        return 0, shape[split_dim(name)]
    return piece.start, piece.stop


def block_of(name: str, num_layers: int) -> int:
    """Exchange bucket: -1 for the embedding, the layer index, num_layers for the final norm / head."""
    layer = layer_of(name)
    if layer is not None:
        return layer
    return -1 if "embed_tokens" in name else num_layers


@dataclass(slots=True)
class Plan:
    """What one group exchanges: per block, each member's slices (in member order); this rank's
    generation intervals."""

    members: list[int]
    blocks: dict[int, list[list[Slice]]] = field(default_factory=dict)
    want: dict[str, Interval] = field(default_factory=dict)


def held_rows(layout: L.Layout, c: L.Coords, name: str, shape: tuple[int, ...], model: ModelShape) -> Interval | None:
    """The rows of `name` a rank at coordinates `c` holds in `layout`; None when its stage lacks it."""
    if not holds(name, model, layout.pp, c.pp):
        return None
    return interval(name, shape, layout.tp, c.tp, model)


def make_plan(
    train: L.Layout,
    gen: L.Layout,
    rank: int,
    shapes: Mapping[str, tuple[int, ...]],
    model: ModelShape,
    *,
    members: list[int] | None = None,
    dedup: bool = True,
    only: set[str] | None = None,
    skip: set[str] | frozenset[str] = frozenset(),
) -> Plan:
    """The exchange of `rank`'s micro-DP group (or of `members`: the fallback and the naive baseline).

    dedup: send each row once and only when some member lacks it (the reshard); False sends every
    held piece of every parameter of the generation stage (the naive all-gather).
    only / skip: restrict the parameters planned.
    """
    g, _ = L.gen_coords(train, gen, rank)
    if members is None:
        members = next(grp for grp in L.micro_dp_groups(train, gen) if rank in grp)
    coords = [L.train_coords(train, r) for r in members]
    plan = Plan(members, {})
    for name, shape in shapes.items():
        if not holds(name, model, gen.pp, g.pp) or name in skip or (only is not None and name not in only):
            continue
        want = interval(name, shape, gen.tp, g.tp, model)
        plan.want[name] = want
        held = [held_rows(train, c, name, shape, model) for c in coords]
        if dedup and all(h is not None and h[0] <= want[0] and want[1] <= h[1] for h in held):
            continue  # every member already holds its generation rows
        slices = _contributions(name, want, held, dedup, members)
        block = plan.blocks.setdefault(block_of(name, model.num_layers), [[] for _ in members])
        for i, s in enumerate(slices):
            if s is not None:
                block[i].append(s)
    return plan


def _contributions(
    name: str, want: Interval, held: list[Interval | None], dedup: bool, members: list[int]
) -> list[Slice | None]:
    """Per member, the rows of `name` it sends; ValueError if the group lacks some wanted rows."""
    out: list[Slice | None] = []
    covered: list[Interval] = []
    for h in held:
        if h is None:
            out.append(None)
            continue
        lo, hi = (h if not dedup else (max(h[0], want[0]), min(h[1], want[1])))
        if lo >= hi or (dedup and any(c[0] <= lo and hi <= c[1] for c in covered)):
            out.append(None)
            continue
        if dedup and any(lo < c[1] and c[0] < hi for c in covered):
            raise ValueError(f"{name}: rows [{lo}, {hi}) overlap rows already gathered; the pieces do not nest")
        covered.append((lo, hi))
        out.append(Slice(name, lo, hi))
    total = sum(max(0, min(c[1], want[1]) - max(c[0], want[0])) for c in covered)
    if total < want[1] - want[0]:
        raise ValueError(
            f"{name}: ranks {members} hold only {total} of the rows [{want[0]}, {want[1]}) their generation "
            f"shard needs (an uneven split that does not nest); this layout pair is not supported"
        )
    return out


def _covered(want: Interval, held: list[Interval]) -> bool:
    """Whether the union of `held` covers `want`."""
    reach = want[0]
    for lo, hi in sorted(held):
        if lo > reach:
            break
        reach = max(reach, hi)
    return reach >= want[1]


def fallback_names(
    train: L.Layout, gen: L.Layout, rank: int, shapes: Mapping[str, tuple[int, ...]], model: ModelShape
) -> set[str]:
    """Parameters that some micro-DP group of `rank`'s training replica cannot assemble from its
    own rows: an uneven split (vocabulary) whose training and generation bounds do not nest, e.g.
    10 rows as 3+3+2+2 over tp=4 but 5+5 over tp=2. Those few are gathered over the training
    model-parallel group instead (the same answer on every rank of it, so they all join)."""
    dp = L.train_coords(train, rank).dp
    groups = [grp for grp in L.micro_dp_groups(train, gen) if L.train_coords(train, grp[0]).dp == dp]
    out = set()
    for grp in groups:
        g, _ = L.gen_coords(train, gen, grp[0])
        coords = [L.train_coords(train, r) for r in grp]
        for name, shape in shapes.items():
            if not holds(name, model, gen.pp, g.pp):
                continue
            held = [h for h in (held_rows(train, c, name, shape, model) for c in coords) if h is not None]
            if not _covered(interval(name, shape, gen.tp, g.tp, model), held):
                out.add(name)
    return out
