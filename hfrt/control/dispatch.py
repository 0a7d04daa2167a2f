"""Spreading one group call over ranks and collecting the replies, by declared dispatch mode.

Pure functions over plain values: it knows the Dispatch modes and each rank's data-parallel
coordinates (the "dp" axis from the daemon's hello, plus any named axes a daemon declares in its
hello meta as {"dp_axes": {"dp": [rank, size], "generation": [rank, size]}}), and nothing of
sockets, futures, tensors or parallel layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hfrt.protocols import BatchHandle
from hfrt.wire.endpoints import Dispatch, chunk_bounds

#: Values a split dispatch cuts by rows: lists, and distributed batch handles (cut without moving bytes).
Splittable = (list, BatchHandle)


#: The data-parallel axis each split mode cuts rows by.
AXIS = {Dispatch.SPLIT: "dp", Dispatch.SPLIT_GENERATION: "generation"}


@dataclass(frozen=True, slots=True)
class RankSlot:
    """One rank of a role group as dispatch sees it. axes: extra named data-parallel coordinates
    (name, rank, size), e.g. ("generation", 1, 2) for a role that generates at its own layout."""

    rank: int
    dp_rank: int
    dp_size: int
    axes: tuple[tuple[str, int, int], ...] = ()

    def coord(self, axis: str) -> tuple[int, int]:
        """(rank, size) on `axis`; the dp coordinate when the rank declared no such axis."""
        for name, rank, size in self.axes:
            if name == axis:
                return rank, size
        return self.dp_rank, self.dp_size

    @staticmethod
    def of(rank: int, dp_rank: int, dp_size: int, meta: dict[str, Any] | None = None) -> RankSlot:
        """A slot from a daemon's hello: meta["dp_axes"] (name → [rank, size]) adds named axes, and
        its "dp" entry, if any, replaces the hello's dp coordinate (a daemon that learned its
        training layout in setup). ValueError names a malformed entry."""
        axes = dict((meta or {}).get("dp_axes") or {})
        for name, value in axes.items():
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and 0 <= int(value[0]) < int(value[1])):
                raise ValueError(f"rank {rank}: dp_axes[{name!r}] = {value!r} is not [rank, size] with 0 <= rank < size")
        if "dp" in axes:
            dp_rank, dp_size = (int(v) for v in axes.pop("dp"))
        return RankSlot(rank, dp_rank, dp_size, tuple((n, int(v[0]), int(v[1])) for n, v in sorted(axes.items())))


def _split_length(endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
    lengths = {f"arg{i}": len(a) for i, a in enumerate(args) if isinstance(a, Splittable)}
    lengths.update({k: len(v) for k, v in kwargs.items() if isinstance(v, Splittable)})
    if not lengths:
        return None
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in lengths.items())
        raise ValueError(f"split dispatch of {endpoint!r}: list arguments differ in length ({shown})")
    return next(iter(lengths.values()))


def dispatch(
    mode: Dispatch,
    endpoint: str,
    ranks: Sequence[RankSlot],
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> list[tuple[RankSlot, list[Any], dict[str, Any]]]:
    """The (rank, args, kwargs) each targeted rank receives."""
    if mode is Dispatch.RANK0:
        return [(ranks[0], list(args), dict(kwargs))]
    if mode is Dispatch.REPLICATE:
        return [(slot, list(args), dict(kwargs)) for slot in ranks]
    n = _split_length(endpoint, args, kwargs)
    if n is None:
        return [(slot, list(args), dict(kwargs)) for slot in ranks]
    axis = AXIS.get(mode, "dp")
    sizes = {slot.coord(axis)[1] for slot in ranks}
    if len(sizes) != 1:
        raise ValueError(f"split dispatch of {endpoint!r}: ranks disagree on the size of data-parallel axis {axis!r}: {sorted(sizes)}")
    bounds = chunk_bounds(n, sizes.pop())
    # each argument cut once per data-parallel rank (tensor/pipeline replicas share their rows' part)
    cut_args = [_cut(a, bounds) for a in args]
    cut_kwargs = {k: _cut(v, bounds) for k, v in kwargs.items()}
    out = []
    for slot in ranks:
        at = slot.coord(axis)[0]
        out.append((slot, [a if c is None else c[at] for a, c in zip(args, cut_args, strict=True)],
                    {k: kwargs[k] if c is None else c[at] for k, c in cut_kwargs.items()}))
    return out


def _cut(value: Any, bounds: Sequence[tuple[int, int]]) -> list[Any] | None:
    """`value`'s rows [lo, hi) for each of `bounds`, or None when it is not split (passed whole)."""
    if isinstance(value, list):
        return [value[lo:hi] for lo, hi in bounds]
    if isinstance(value, BatchHandle):
        return [value.slice(lo, hi) for lo, hi in bounds]
    return None


def collect(mode: Dispatch, slots: Sequence[RankSlot], results: Sequence[Any]) -> Any:
    """Combine per-rank results (in the order of `slots`) into what the caller awaits."""
    if mode is Dispatch.RANK0:
        return results[0]
    if mode is Dispatch.REPLICATE:
        return list(results)
    axis = AXIS.get(mode, "dp")
    seen: dict[int, Any] = {}
    for slot, result in zip(slots, results, strict=True):
        seen.setdefault(slot.coord(axis)[0], result)  # tensor/pipeline replicas answer the same rows
    ordered = [seen[d] for d in sorted(seen)]
    if all(isinstance(r, list) for r in ordered):
        return [item for r in ordered for item in r]
    if all(isinstance(r, BatchHandle) for r in ordered):
        return BatchHandle.concat(ordered)  # one distributed batch: a shard per data-parallel rank
    return ordered
