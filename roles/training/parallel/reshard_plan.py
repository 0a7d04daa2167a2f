"""The exchange plan of a 3D-HybridEngine transition: from two layouts, the full parameter shapes
and each parameter's split dim on each side, which member of a micro-DP group sends which rows of
which parameter, so no sizes travel.

Pieces follow DTensor's Shard rule (tp_plan.chunk_bounds) along the dim the TP plan split
(`Params.train_dims` / `gen_dims`, from tp_plan.split_dims; None: every tp rank holds it whole).
A micro-DP group's training pieces cover exactly its generation piece (layout.py), so gathered
bytes never exceed one generation shard. The exception is a parameter whose training and
generation pieces do not nest (the vocabulary split over tp=2 for training but kept whole at a
generation tp that does not divide it; an uneven chunking): those alone are planned over the
training model-parallel group (`fallback_names`). Pure logic: it knows parameter names, shapes
and split dims, and nothing of tensors, collectives, engines or model families.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel.stages import holds, is_input_embedding, layer_of
from hfrt.roles.training.parallel.tp_plan import chunk_bounds

Interval = tuple[int, int]
Dims = Mapping[str, "int | None"]


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows [start, stop) of parameter `name` along its split dim (full-tensor coordinates)."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class Params:
    """What a plan knows of the model: every parameter's full shape (HF names, tied aliases once),
    its split dim at the training tp and at the generation tp (None or absent: held whole), and
    the number of decoder layers (for pipeline stages)."""

    shapes: dict[str, tuple[int, ...]]
    train_dims: dict[str, int | None]
    gen_dims: dict[str, int | None]
    num_layers: int

    def __post_init__(self) -> None:
        for name, shape in self.shapes.items():
            a, b = self.train_dims.get(name), self.gen_dims.get(name)
            if a is not None and b is not None and a != b:
                raise ValueError(f"{name}: split along dim {a} for training but dim {b} for generation")
            if not shape:
                raise ValueError(f"{name}: a 0-d parameter cannot be resharded")

    def axis(self, name: str) -> int:
        """The dim rows are counted along: the split dim of either side, else 0."""
        a = self.train_dims.get(name)
        if a is None:
            a = self.gen_dims.get(name)
        return 0 if a is None else a

    def rows(self, name: str) -> int:
        return self.shapes[name][self.axis(name)]


def interval(params: Params, dims: Dims, name: str, tp: int, tp_rank: int) -> Interval:
    """The rows of `name` tp rank `tp_rank` of `tp` holds (all of them when it is not split)."""
    size = params.rows(name)
    if tp == 1 or dims.get(name) is None:
        return 0, size
    return chunk_bounds(size, tp, tp_rank)


def block_of(name: str, num_layers: int) -> int:
    """Exchange bucket: -1 for the input embedding, the layer index, num_layers for the rest."""
    layer = layer_of(name)
    if layer is not None:
        return layer
    return -1 if is_input_embedding(name) else num_layers


@dataclass(slots=True)
class Plan:
    """What one group exchanges: per block, each member's slices (in member order); this rank's
    generation intervals."""

    members: list[int]
    blocks: dict[int, list[list[Slice]]] = field(default_factory=dict)
    want: dict[str, Interval] = field(default_factory=dict)


def held_rows(layout: L.Layout, c: L.Coords, name: str, params: Params, dims: Dims) -> Interval | None:
    """The rows of `name` a rank at coordinates `c` holds in `layout`; None when its stage lacks it."""
    if not holds(name, params.num_layers, layout.pp, c.pp, layout.vpp):
        return None
    return interval(params, dims, name, layout.tp, c.tp)


def make_plan(
    train: L.Layout,
    gen: L.Layout,
    rank: int,
    params: Params,
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
    for name in params.shapes:
        if not holds(name, params.num_layers, gen.pp, g.pp) or name in skip or (only is not None and name not in only):
            continue
        want = interval(params, params.gen_dims, name, gen.tp, g.tp)
        plan.want[name] = want
        held = [held_rows(train, c, name, params, params.train_dims) for c in coords]
        if dedup and all(h is not None and h[0] <= want[0] and want[1] <= h[1] for h in held):
            continue  # every member already holds its generation rows
        slices = _contributions(name, want, held, dedup, members)
        block = plan.blocks.setdefault(block_of(name, params.num_layers), [[] for _ in members])
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
            f"shard needs (pieces that do not nest); this layout pair is not supported"
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


def fallback_names(train: L.Layout, gen: L.Layout, rank: int, params: Params) -> set[str]:
    """Parameters that some micro-DP group of `rank`'s training replica cannot assemble from its
    own rows: pieces that do not nest, e.g. a 10-row vocabulary split 5+5 at training tp=2 but
    whole at generation tp=4 (which does not divide it). Those few are gathered over the training
    model-parallel group instead (the same answer on every rank of it, so they all join)."""
    dp = L.train_coords(train, rank).dp
    groups = [grp for grp in L.micro_dp_groups(train, gen) if L.train_coords(train, grp[0]).dp == dp]
    out = set()
    for grp in groups:
        g, _ = L.gen_coords(train, gen, grp[0])
        coords = [L.train_coords(train, r) for r in grp]
        for name in params.shapes:
            if not holds(name, params.num_layers, gen.pp, g.pp):
                continue
            held = [h for h in (held_rows(train, c, name, params, params.train_dims) for c in coords) if h is not None]
            if not _covered(interval(params, params.gen_dims, name, gen.tp, g.tp), held):
                out.add(name)
    return out
