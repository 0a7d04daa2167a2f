"""The 3D-HybridEngine transition: a rank's training pieces → its generation pieces, gathering only
inside its micro-DP group, and back (dropping the generation copy).

Every rank computes the same exchange plan (reshard_plan.py) and runs it (exchange.py); the full
model is built only when the generation layout is t1p1. The naive baseline
(`naive_to_generation`) all-gathers every piece over the training model-parallel group, builds the
full model, then slices. FSDP's all-gather over the training dp group is not part of a transition
(it is paid by every forward); `dp_gather` does it and counts it separately. It knows no engines,
no models beyond parameter names, shapes and split dims (reshard_plan.Params), and no optimizer
state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel.exchange import Stats, exchange, narrow_rows, synchronize
from hfrt.roles.training.parallel.reshard_plan import (
    Interval,
    Params,
    Plan,
    block_of,
    fallback_names,
    held_rows,
    interval,
    make_plan,
)
from hfrt.roles.training.parallel.stages import holds, is_input_embedding

if TYPE_CHECKING:
    from torch import Tensor


class Resharder:
    """Training pieces ↔ generation pieces of one rank. All ranks call to_generation together."""

    def __init__(
        self,
        train: L.Layout,
        gen: L.Layout,
        rank: int,
        params: Params,
        groups: L.RankGroups | None = None,
    ) -> None:
        L.check_pair(train, gen)
        for layout in (train, gen):
            if layout.pp > params.num_layers:
                raise ValueError(f"layout {layout}: pp={layout.pp} exceeds the model's {params.num_layers} layers")
        self.train, self.gen, self.rank, self.params = train, gen, rank, params
        self.fallback = fallback_names(train, gen, rank, params)
        self.plan = make_plan(train, gen, rank, params, skip=self.fallback)
        self.fallback_plan: Plan | None = None
        if self.fallback:
            members = next(grp for grp in L.train_mp_groups(train) if rank in grp)
            self.fallback_plan = make_plan(train, gen, rank, params, members=members, dedup=False, only=self.fallback)
        if groups is None and (len(self.plan.members) > 1 or self.fallback_plan is not None):
            raise ValueError(f"rank {rank}: {train} → {gen} gathers over micro-DP group {self.plan.members}; pass its groups")
        self.groups = groups
        self.coords = L.train_coords(train, rank)
        self.pieces: dict[str, Tensor] = {}
        self.last = Stats()

    def held(self, name: str) -> Interval | None:
        return held_rows(self.train, self.coords, name, self.params, self.params.train_dims)

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
            out = exchange(self.plan, self.rank, micro, pieces, self.held, self.params, stats)
            if self.fallback_plan is not None:
                assert self.groups is not None
                out |= exchange(self.fallback_plan, self.rank, self.groups.train_mp, pieces, self.held, self.params, stats)
            self.pieces = out
            synchronize()
        stats.time_s, stats.peak_rss_mb = time.perf_counter() - start, peak.peak_mb
        self.last = stats
        return self.pieces

    def stream(
        self, blocks: Iterable[Mapping[str, Tensor]], units: list[list[str]], *, copy: bool = False
    ) -> Iterator[tuple[str, Tensor]]:
        """This rank's generation pieces as (name, tensor), one exchange unit at a time: the
        transition without ever holding the whole training shard twice. `units` are the full-model
        names in the order `blocks` comes in (an engine's buckets and local_pieces(): one
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
                if any(is_input_embedding(n) for n in names):
                    names.add("lm_head.weight")  # a tied head on the last stage comes under its own name
                nxt = source.peek()
                pieces: Mapping[str, Tensor] = {}
                if nxt is not None and names & set(nxt):
                    pieces = source.pop()
                    extra = set(pieces) - names
                    if extra:
                        raise ValueError(f"rank {self.rank}: block {sorted(pieces)[:3]}… does not match the unit {unit[:3]}…")
                wanted = {block_of(n, self.params.num_layers) for n in unit}
                out = exchange(self.plan, self.rank, micro, pieces, self.held, self.params, stats,
                               names=names, blocks=wanted, copy=copy, like=like_tensor)  # fmt: skip
                if self.fallback_plan is not None:
                    assert self.groups is not None
                    out |= exchange(self.fallback_plan, self.rank, self.groups.train_mp, pieces, self.held, self.params,
                                    stats, names=names, blocks=wanted, copy=copy, like=like_tensor)  # fmt: skip
                del pieces
                yield from out.items()
                del out
            if source.peek() is not None:
                raise ValueError(f"rank {self.rank}: the training engine yielded blocks outside the units")
            synchronize()
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
    params: Params,
    pieces: Mapping[str, Tensor],
    groups: L.RankGroups,
) -> tuple[dict[str, Tensor], Stats]:
    """The baseline: every rank all-gathers every piece of its training model-parallel group (the
    full model), then copies out its generation pieces and drops the full model."""
    from hfrt.roles.generation.hybrid import PeakRSS

    stats = Stats()
    start = time.perf_counter()
    full_layout = L.Layout(1, 1, train.world)
    plan = make_plan(train, full_layout, rank, params, members=groups.train_mp_ranks, dedup=False)
    coords = L.train_coords(train, rank)

    def held(name: str) -> Interval | None:
        return held_rows(train, coords, name, params, params.train_dims)

    g, _ = L.gen_coords(train, gen, rank)
    with PeakRSS() as peak:
        full = exchange(plan, rank, groups.train_mp, pieces, held, params, stats)
        out = {}
        for name, tensor in full.items():
            if holds(name, params.num_layers, gen.pp, g.pp):
                want = interval(params, params.gen_dims, name, gen.tp, g.tp)
                out[name] = narrow_rows(tensor, params.axis(name), (0, params.rows(name)), want).clone()
        del full
        synchronize()
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

