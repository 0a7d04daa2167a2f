"""Rows and ranks for role endpoints: collectives over the role's own process group, equal row
counts per rank before sharded engine calls, and turning endpoint Batches into engine inputs.

Why equal rows: FSDP2 and ZeRO-3 gather weights inside every forward, so every rank of the group
must run the same number of micro-batches. A rank with fewer rows (an uneven split) gets copies
of its first row with `response_mask` zeroed, which add nothing to losses or token counts, and
they are cut off again afterwards. Every function here that takes no explicit group is collective
when the role has a process group: all ranks must call it, in the same order. It knows nothing of
losses, models or the wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hfrt.daemon.batch import Batch

Tensors = dict[str, torch.Tensor]


def group_size() -> int:
    """Ranks in the role's process group (1 when it has none)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: Sequence[float], op: str = "sum", group: Any = None) -> list[float]:
    """Element-wise sum / max / min over the group's ranks (the values themselves with no group).
    `group`: a sub-group, e.g. a tensor-parallel engine's data-parallel group (default: all ranks)."""
    if group_size() == 1:
        return [float(v) for v in values]
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    work = torch.tensor(list(values), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(work, op=ops[op], group=group)
    return [float(v) for v in work.cpu().tolist()]


def reduce_metrics(metrics: Mapping[str, float], op: str = "max", group: Any = None) -> dict[str, float]:
    """The same metrics on every rank: reduced key by key (every rank must have the same keys)."""
    keys = sorted(metrics)
    return dict(zip(keys, all_reduce([float(metrics[k]) for k in keys], op, group), strict=True))


def check_rows(rows: int, endpoint: str) -> int:
    """Every rank learns the smallest and largest row count; all raise together when a rank got
    none (so no rank is left waiting in a collective). Returns the largest."""
    low, neg_high = all_reduce([rows, -rows], "min")
    high = -neg_high
    if low < 1:
        raise ValueError(
            f"{endpoint}: a data-parallel rank received no rows ({int(high)} at most per rank); "
            f"send at least as many rows as the role has data-parallel ranks ({group_size()})"
        )
    return int(high)


def merge(batch: Batch, extra: Iterable[Batch] = ()) -> Batch:
    """Columns of several batches of the same rows (later ones add columns, never replace them);
    meta from all, the first batch's winning."""
    out = batch
    for other in extra:
        if len(other) != len(out):
            raise ValueError(f"batches to merge have {len(out)} and {len(other)} rows")
        out = Batch(
            {**other.tensors, **out.tensors},
            {**other.non_tensor, **out.non_tensor},
            {**other.meta, **out.meta},
        )
    return out


def take(batch: Batch, names: Iterable[str], endpoint: str) -> Tensors:
    """The named tensor columns, or a KeyError naming what is missing and what the batch has."""
    wanted = list(names)
    missing = [n for n in wanted if n not in batch.tensors]
    if missing:
        raise KeyError(f"{endpoint} needs tensor column(s) {missing}; the batch has {batch.keys()}")
    return {n: batch.tensors[n] for n in wanted}


def pad_rows(tensors: Tensors, rows: int) -> tuple[Tensors, int]:
    """Append copies of row 0 (response_mask zeroed) until there are `rows` rows; (padded, pad)."""
    have = int(next(iter(tensors.values())).shape[0])
    pad = rows - have
    if pad <= 0:
        return tensors, 0
    out = {}
    for name, t in tensors.items():
        filler = t[:1].expand(pad, *t.shape[1:])
        if name == "response_mask":
            filler = torch.zeros_like(filler)
        out[name] = torch.cat([t, filler])
    return out, pad


def equal_rows(tensors: Tensors, endpoint: str) -> tuple[Tensors, int]:
    """Pad to the group's largest row count (collective); returns (padded, pad)."""
    rows = int(next(iter(tensors.values())).shape[0]) if tensors else 0
    return pad_rows(tensors, check_rows(rows, endpoint))


def unpad(t: torch.Tensor, pad: int) -> torch.Tensor:
    return t[: t.shape[0] - pad] if pad else t


#: Columns every forward pass reads (position_ids is used when present).
FORWARD_COLUMNS = ("input_ids", "attention_mask", "responses", "response_mask")


def forward_inputs(batch: Batch, endpoint: str, *more: str) -> dict[str, torch.Tensor]:
    """The tensors a forward pass (plus the `more` columns) reads from `batch`, checked by `take`."""
    names = [*FORWARD_COLUMNS, *more] + (["position_ids"] if "position_ids" in batch.tensors else [])
    return take(batch, names, endpoint)
