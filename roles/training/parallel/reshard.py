"""The 3D-HybridEngine transition: a rank's training pieces → its generation pieces, gathering only
inside its micro-DP group, and back (dropping the generation copy).

Every rank computes the same exchange plan from the two layouts and the full parameter shapes
(which member sends which rows of which parameter), so no sizes travel. A micro-DP group's
training pieces cover exactly its generation piece (layout.py), so gathered bytes never exceed one
generation shard and the full model is built only when the generation layout is t1p1. The one
exception is an uneven split whose bounds do not nest (a vocabulary of 10 rows is 3+3+2+2 at
tp=4 but 5+5 at tp=2): those parameters alone are all-gathered over the training model-parallel
group (`fallback_names`). Where a
generation piece equals a training piece (equal layouts; norms replicated over tp) it *is* the
training tensor (shared storage, no bytes); where it lies inside one (generation more sharded) it
is a view of it. The naive baseline (`naive_to_generation`) all-gathers every piece over the
training model-parallel group, builds the full model, then slices.

Bytes are counted from the tensors handed to the collectives: received = the other members'
buffers this rank got, sent = its own buffer times the members that got it (payload, not the
algorithm's relays). FSDP's all-gather over the training dp group is not part of a transition
(it is paid by every forward); `dp_gather` does it and counts it separately. It knows no engines,
no models beyond parameter names and shapes, and no optimizer state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel.shard import ModelShape, holds, layer_of, split_kind, tp_piece

if TYPE_CHECKING:
    from torch import Tensor

Interval = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows [start, stop) of parameter `name` along its split dim (full-tensor coordinates)."""

    name: str
    start: int
    stop: int


@dataclass(slots=True)
class Stats:
    """One transition on this rank."""

    bytes_sent: int = 0
    bytes_received: int = 0
    time_s: float = 0.0
    peak_rss_mb: float = 0.0
    shared: int = 0  # generation tensors that are the training tensor or a view of it
    built: int = 0  # generation tensors assembled from gathered rows

    def as_metrics(self, prefix: str = "reshard/") -> dict[str, float]:
        return {
            f"{prefix}bytes_sent": float(self.bytes_sent),
            f"{prefix}bytes_received": float(self.bytes_received),
            f"{prefix}time_s": self.time_s,
            f"{prefix}peak_rss_mb": self.peak_rss_mb,
        }


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


def _held(layout: L.Layout, c: L.Coords, name: str, shape: tuple[int, ...], model: ModelShape) -> Interval | None:
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
        held = [_held(train, c, name, shape, model) for c in coords]
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
            held = [h for h in (_held(train, c, name, shape, model) for c in coords) if h is not None]
            if not _covered(interval(name, shape, gen.tp, g.tp, model), held):
                out.add(name)
    return out


def _narrow(t: Tensor, name: str, held: Interval, rows: Interval) -> Tensor:
    """Rows `rows` (full coordinates) of a local tensor that holds rows `held`."""
    return t.narrow(split_dim(name), rows[0] - held[0], rows[1] - rows[0])


def _slice_shape(shape: tuple[int, ...], name: str, s: Slice) -> list[int]:
    out = list(shape)
    out[split_dim(name)] = s.stop - s.start
    return out


class Resharder:
    """Training pieces ↔ generation pieces of one rank. All ranks call to_generation together."""

    def __init__(
        self,
        train: L.Layout,
        gen: L.Layout,
        rank: int,
        shapes: Mapping[str, tuple[int, ...]],
        model: ModelShape,
        groups: L.RankGroups | None = None,
    ) -> None:
        L.check_pair(train, gen, model)
        self.train, self.gen, self.rank, self.model = train, gen, rank, model
        self.shapes = dict(shapes)
        self.fallback = fallback_names(train, gen, rank, self.shapes, model)
        self.plan = make_plan(train, gen, rank, self.shapes, model, skip=self.fallback)
        self.fallback_plan: Plan | None = None
        if self.fallback:
            members = next(grp for grp in L.train_mp_groups(train) if rank in grp)
            self.fallback_plan = make_plan(train, gen, rank, self.shapes, model, members=members, dedup=False, only=self.fallback)
        if groups is None and (len(self.plan.members) > 1 or self.fallback_plan is not None):
            raise ValueError(f"rank {rank}: {train} → {gen} gathers over micro-DP group {self.plan.members}; pass its groups")
        self.groups = groups
        self.coords = L.train_coords(train, rank)
        self.pieces: dict[str, Tensor] = {}
        self.last = Stats()

    def held(self, name: str) -> Interval | None:
        return _held(self.train, self.coords, name, self.shapes[name], self.model)

    def to_generation(
        self, pieces: Mapping[str, Tensor] | Iterable[Mapping[str, Tensor]], *, copy: bool = False
    ) -> dict[str, Tensor]:
        """This rank's generation pieces (full HF names → tensors) from its training pieces: one
        mapping, or blocks of them (an engine's `local_pieces()`, exhausted here). copy=True clones
        each training piece first (an FSDP engine's pieces are views of temporary buffers)."""
        from hfrt.roles.generation.hybrid import PeakRSS

        stats = Stats()
        start = time.perf_counter()
        with PeakRSS() as peak:
            if not isinstance(pieces, Mapping):
                pieces = {n: (t.clone() if copy else t) for block in pieces for n, t in block.items()}
            elif copy:
                pieces = {n: t.clone() for n, t in pieces.items()}
            micro = self.groups.micro_dp if self.groups is not None else None
            out = exchange(self.plan, self.rank, micro, pieces, self.held, self.shapes, stats)
            if self.fallback_plan is not None:
                assert self.groups is not None
                out |= exchange(self.fallback_plan, self.rank, self.groups.train_mp, pieces, self.held, self.shapes, stats)
            self.pieces = out
            _synchronize()
        stats.time_s, stats.peak_rss_mb = time.perf_counter() - start, peak.peak_mb
        self.last = stats
        return self.pieces

    def stream(
        self, blocks: Iterable[Mapping[str, Tensor]], units: list[list[str]], *, copy: bool = False
    ) -> Iterator[tuple[str, Tensor]]:
        """This rank's generation pieces as (name, tensor), one exchange unit at a time: the
        transition without ever holding the whole training shard twice. `units` are the full-model
        names in the order `blocks` comes in (an engine's layout.buckets and local_pieces(): one
        block per unit this rank holds, none for the others); every rank passes the same units, so
        the micro-DP collectives line up. A block is pulled only when its unit is exchanged, and
        nothing of it is kept but the generation rows: with copy=False (the pieces are the training
        parameters themselves) a kept piece *is* the training tensor or a view of it; with
        copy=True (views of FSDP's temporary dp-gather buffers, invalid once the next block is
        pulled) only the wanted rows are cloned. Stats land in `.last` when the stream is
        exhausted; the consumer must exhaust it (collective)."""
        from hfrt.roles.generation.hybrid import PeakRSS

        stats = Stats()
        start = time.perf_counter()
        source = _Lookahead(iter(blocks))
        like = source.peek()
        if like is None:
            raise ValueError(f"rank {self.rank}: the training engine yielded no pieces")
        like_tensor = next(iter(like.values()))
        micro = self.groups.micro_dp if self.groups is not None else None
        with PeakRSS() as peak:
            for unit in units:
                names = set(unit)
                if "model.embed_tokens.weight" in names:
                    names.add("lm_head.weight")  # a tied head on the last stage comes under its own name
                nxt = source.peek()
                pieces: Mapping[str, Tensor] = {}
                if nxt is not None and names & set(nxt):
                    pieces = source.pop()
                    extra = set(pieces) - names
                    if extra:
                        raise ValueError(f"rank {self.rank}: block {sorted(pieces)[:3]}… does not match the unit {unit[:3]}…")
                wanted = {b for b in (block_of(n, self.model.num_layers) for n in unit)}
                out = exchange(self.plan, self.rank, micro, pieces, self.held, self.shapes, stats,
                               names=names, blocks=wanted, copy=copy, like=like_tensor)  # fmt: skip
                if self.fallback_plan is not None:
                    assert self.groups is not None
                    out |= exchange(self.fallback_plan, self.rank, self.groups.train_mp, pieces, self.held, self.shapes,
                                    stats, names=names, blocks=wanted, copy=copy, like=like_tensor)  # fmt: skip
                del pieces
                yield from out.items()
                del out
            if source.peek() is not None:
                raise ValueError(f"rank {self.rank}: the training engine yielded blocks outside the units")
            _synchronize()
        stats.time_s, stats.peak_rss_mb = time.perf_counter() - start, peak.peak_mb
        self.last = stats

    def to_train(self) -> dict[str, float]:
        """Drop the generation copy (shared tensors stay with training; assembled ones are freed)."""
        start = time.perf_counter()
        self.pieces = {}
        return {"reshard/to_train_s": time.perf_counter() - start}


def naive_to_generation(
    train: L.Layout,
    gen: L.Layout,
    rank: int,
    shapes: Mapping[str, tuple[int, ...]],
    model: ModelShape,
    pieces: Mapping[str, Tensor],
    groups: L.RankGroups,
) -> tuple[dict[str, Tensor], Stats]:
    """The baseline: every rank all-gathers every piece of its training model-parallel group (the
    full model), then copies out its generation pieces and drops the full model."""
    from hfrt.roles.generation.hybrid import PeakRSS

    stats = Stats()
    start = time.perf_counter()
    full_layout = L.Layout(1, 1, train.world)
    plan = make_plan(train, full_layout, rank, shapes, model, members=groups.train_mp_ranks, dedup=False)
    coords = L.train_coords(train, rank)

    def held(name: str) -> Interval | None:
        return _held(train, coords, name, shapes[name], model)

    g, _ = L.gen_coords(train, gen, rank)
    with PeakRSS() as peak:
        full = exchange(plan, rank, groups.train_mp, pieces, held, shapes, stats)
        out = {}
        for name, tensor in full.items():
            if holds(name, model, gen.pp, g.pp):
                want = interval(name, shapes[name], gen.tp, g.tp, model)
                out[name] = _narrow(tensor, name, (0, shapes[name][split_dim(name)]), want).clone()
        del full
        _synchronize()
    stats.time_s, stats.peak_rss_mb = time.perf_counter() - start, peak.peak_mb
    return out, stats


def dp_gather(pieces: Mapping[str, Tensor], group: Any, dp: int, dp_rank: int) -> tuple[dict[str, Tensor], Stats]:
    """FSDP's unshard, for the bench's starting state: this rank keeps 1/dp of its flattened pieces
    and all-gathers them over its training dp group back into its pieces. Counted apart from the
    transition (every training forward pays it)."""
    stats = Stats()
    flat = torch.cat([t.reshape(-1) for t in pieces.values()])
    per = -(-flat.numel() // dp)
    padded = torch.zeros(per * dp, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    mine = padded[dp_rank * per : (dp_rank + 1) * per].clone()
    del padded, flat
    start = time.perf_counter()
    if dp > 1:
        parts = [torch.empty_like(mine) for _ in range(dp)]
        dist.all_gather(parts, mine, group=group)
        gathered = torch.cat(parts)
        stats.bytes_received = per * (dp - 1) * mine.element_size()
        stats.bytes_sent = stats.bytes_received
    else:
        gathered = mine
    out, offset = {}, 0
    for name, t in pieces.items():
        out[name] = gathered[offset : offset + t.numel()].view(t.shape).clone()
        offset += t.numel()
    stats.time_s = time.perf_counter() - start
    return out, stats


def exchange(
    plan: Plan,
    rank: int,
    group: Any,
    pieces: Mapping[str, Tensor],
    held: Any,
    shapes: Mapping[str, tuple[int, ...]],
    stats: Stats,
    *,
    names: set[str] | None = None,
    blocks: set[int] | None = None,
    copy: bool = False,
    like: Tensor | None = None,
) -> dict[str, Tensor]:
    """Run the plan block by block; return the generation pieces (shared where possible).
    names / blocks: only these parameters and exchange blocks (one unit of a stream; `like` then
    gives dtype and device, as this rank may hold none of them). copy: clone the kept rows of a
    shared piece instead of viewing them."""
    me = plan.members.index(rank)
    if like is None:
        like = next(iter(pieces.values()))
    out: dict[str, Tensor] = {}
    for name, want in plan.want.items():  # shared: held rows already cover the wanted ones
        if names is not None and name not in names:
            continue
        mine = held(name)
        if mine is not None and mine[0] <= want[0] and want[1] <= mine[1]:
            if name not in pieces:
                raise KeyError(f"rank {rank}: the training pieces lack {name!r} that this rank holds")
            kept = pieces[name] if mine == want else _narrow(pieces[name], name, mine, want)
            out[name] = kept.clone() if copy else kept
            stats.shared += 1
    built: set[str] = set()
    for block in sorted(plan.blocks if blocks is None else blocks & plan.blocks.keys()):
        slices = plan.blocks[block]
        sizes = [sum(_numel(shapes[s.name], s) for s in member) for member in slices]
        if len(sizes) == 1 or not any(sizes):  # the same decision on every member
            continue
        flat = _pack(slices[me], pieces, held)
        bufs = _all_gather_v(flat, sizes, me, plan.members, group, like, stats)
        for j, member in enumerate(slices):
            offset = 0
            for s in member:
                n = _numel(shapes[s.name], s)
                if j != me and (s.name not in out or s.name in built):
                    if s.name not in out:
                        out[s.name] = _allocate(s.name, shapes[s.name], plan.want[s.name], pieces, held, like)
                        built.add(s.name)
                    src = bufs[j].narrow(0, offset, n).view(_slice_shape(shapes[s.name], s.name, s))  # type: ignore[union-attr]
                    _copy_rows(out[s.name], plan.want[s.name], src, (s.start, s.stop), s.name)
                offset += n
        del bufs, flat
    stats.built += len(built)
    missing = [n for n in plan.want if n not in out and (names is None or n in names)]
    if missing:
        raise RuntimeError(f"rank {rank}: generation pieces never assembled: {missing[:5]}")
    return out


def _numel(shape: tuple[int, ...], s: Slice) -> int:
    n = s.stop - s.start
    for i, d in enumerate(shape):
        if i != split_dim(s.name):
            n *= d
    return n


def _pack(slices: list[Slice], pieces: Mapping[str, Tensor], held: Any) -> Tensor | None:
    parts = [_narrow(pieces[s.name], s.name, held(s.name), (s.start, s.stop)).reshape(-1) for s in slices]
    return torch.cat(parts) if parts else None


def _all_gather_v(
    flat: Tensor | None, sizes: list[int], me: int, members: list[int], group: Any, like: Tensor, stats: Stats
) -> list[Tensor | None]:
    """Every member's buffer (None for empty ones): one all_gather when sizes agree, else a
    broadcast per non-empty member (sizes are known from the plan, so nothing else travels)."""
    bufs: list[Tensor | None] = [None] * len(sizes)
    if len(set(sizes)) == 1 and flat is not None:
        out = [torch.empty(sizes[0], dtype=like.dtype, device=like.device) for _ in sizes]
        dist.all_gather(out, flat, group=group)
        bufs = list(out)
    else:
        for j, src in enumerate(members):
            if not sizes[j]:
                continue
            buf = flat if j == me else torch.empty(sizes[j], dtype=like.dtype, device=like.device)
            assert buf is not None
            dist.broadcast(buf, src=src, group=group)
            bufs[j] = buf
    size = like.element_size()
    stats.bytes_received += sum(n for j, n in enumerate(sizes) if j != me) * size
    stats.bytes_sent += sizes[me] * (len(sizes) - 1) * size
    return bufs


def _copy_rows(target: Tensor, target_rows: Interval, src: Tensor, src_rows: Interval, name: str) -> None:
    rows = (max(src_rows[0], target_rows[0]), min(src_rows[1], target_rows[1]))
    if rows[0] < rows[1]:
        _narrow(target, name, target_rows, rows).copy_(_narrow(src, name, src_rows, rows))


def _allocate(
    name: str, shape: tuple[int, ...], want: Interval, pieces: Mapping[str, Tensor], held: Any, like: Tensor
) -> Tensor:
    """An empty generation piece with this rank's own rows already copied in."""
    dims = list(shape)
    dims[split_dim(name)] = want[1] - want[0]
    target = torch.empty(dims, dtype=like.dtype, device=like.device)
    mine = held(name)
    if mine is not None:
        _copy_rows(target, want, pieces[name], mine, name)
    return target


class _Lookahead:
    """An iterator of blocks whose next item can be looked at without being consumed (pulling a
    block from an FSDP engine resumes it, which frees the previous block's buffers)."""

    _END: Any = object()

    def __init__(self, it: Iterator[Mapping[str, Tensor]]) -> None:
        self._it = it
        self._next: Any = None

    def peek(self) -> Mapping[str, Tensor] | None:
        if self._next is None:
            self._next = next(self._it, self._END)
        return None if self._next is self._END else self._next

    def pop(self) -> Mapping[str, Tensor]:
        item = self.peek()
        assert item is not None
        self._next = None
        return item


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
