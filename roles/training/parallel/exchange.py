"""Running an exchange plan (reshard_plan.py): each micro-DP group member packs the rows it sends,
the group all-gathers them (or broadcasts member by member when sizes differ), and each rank
assembles its generation pieces. Where a generation piece equals or lies inside a training piece it
*is* that tensor or a view of it (no bytes).

Bytes are counted from the tensors handed to the collectives: received = the other members'
buffers this rank got, sent = its own buffer times the members that got it (payload, not the
algorithm's relays). It knows plans, tensors and torch.distributed; nothing of layouts' meaning,
engines or models beyond parameter names, shapes and split dims.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hfrt.roles.training.parallel.reshard_plan import Interval, Params, Plan, Slice

if TYPE_CHECKING:
    from torch import Tensor


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


def narrow_rows(t: Tensor, dim: int, held: Interval, rows: Interval) -> Tensor:
    """Rows `rows` (full coordinates, along `dim`) of a local tensor that holds rows `held`."""
    return t.narrow(dim, rows[0] - held[0], rows[1] - rows[0])


def _slice_shape(params: Params, s: Slice) -> list[int]:
    out = list(params.shapes[s.name])
    out[params.axis(s.name)] = s.stop - s.start
    return out


def exchange(
    plan: Plan,
    rank: int,
    group: Any,
    pieces: Mapping[str, Tensor],
    held: Any,
    params: Params,
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
            kept = pieces[name] if mine == want else narrow_rows(pieces[name], params.axis(name), mine, want)
            out[name] = kept.clone() if copy else kept
            stats.shared += 1
    built: set[str] = set()
    for block in sorted(plan.blocks if blocks is None else blocks & plan.blocks.keys()):
        slices = plan.blocks[block]
        sizes = [sum(_numel(params, s) for s in member) for member in slices]
        if len(sizes) == 1 or not any(sizes):  # the same decision on every member
            continue
        flat = _pack(slices[me], pieces, held, params)
        bufs = _all_gather_v(flat, sizes, me, plan.members, group, like, stats)
        for j, member in enumerate(slices):
            offset = 0
            for s in member:
                n = _numel(params, s)
                if j != me and (s.name not in out or s.name in built):
                    if s.name not in out:
                        out[s.name] = _allocate(s.name, params, plan.want[s.name], pieces, held, like)
                        built.add(s.name)
                    src = bufs[j].narrow(0, offset, n).view(_slice_shape(params, s))  # type: ignore[union-attr]
                    _copy_rows(out[s.name], plan.want[s.name], src, (s.start, s.stop), params.axis(s.name))
                offset += n
        del bufs, flat
    stats.built += len(built)
    missing = [n for n in plan.want if n not in out and (names is None or n in names)]
    if missing:
        raise RuntimeError(f"rank {rank}: generation pieces never assembled: {missing[:5]}")
    return out


def _numel(params: Params, s: Slice) -> int:
    n, axis = s.stop - s.start, params.axis(s.name)
    for i, d in enumerate(params.shapes[s.name]):
        if i != axis:
            n *= d
    return n


def _pack(slices: list[Slice], pieces: Mapping[str, Tensor], held: Any, params: Params) -> Tensor | None:
    parts = [narrow_rows(pieces[s.name], params.axis(s.name), held(s.name), (s.start, s.stop)).reshape(-1) for s in slices]
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


def _copy_rows(target: Tensor, target_rows: Interval, src: Tensor, src_rows: Interval, dim: int) -> None:
    rows = (max(src_rows[0], target_rows[0]), min(src_rows[1], target_rows[1]))
    if rows[0] < rows[1]:
        narrow_rows(target, dim, target_rows, rows).copy_(narrow_rows(src, dim, src_rows, rows))


def _allocate(name: str, params: Params, want: Interval, pieces: Mapping[str, Tensor], held: Any, like: Tensor) -> Tensor:
    """An empty generation piece with this rank's own rows already copied in."""
    dims = list(params.shapes[name])
    dims[params.axis(name)] = want[1] - want[0]
    target = torch.empty(dims, dtype=like.dtype, device=like.device)
    mine = held(name)
    if mine is not None:
        _copy_rows(target, want, pieces[name], mine, params.axis(name))
    return target


def synchronize() -> None:
    """Wait for queued CUDA work (so a transition's time and memory are its own); a no-op on CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
