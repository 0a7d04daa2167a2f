"""Batches the controller makes and reads itself: a batch of prompts carried inline (no daemon owns
it), the non-tensor columns of a batch handle, and rollout chunks joined into one handle.

No torch and no bytes: it handles BatchHandle records only; it never pulls a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfrt.protocols import BatchHandle
from hfrt.serve.turns import non_tensor, prompts_handle

__all__ = ["concat_rollouts", "non_tensor", "prompts_handle"]


def concat_rollouts(parts: Sequence[BatchHandle]) -> BatchHandle:
    """Rollout chunks one after another, with one meta for the whole: response_tokens, timing/*
    and reshard/* summed (the actor's time and pushes over all its calls), memory/* and
    response_length/max the max, response_length/min the min, response_length/mean and clip_ratio
    weighted by rows; anything else from the first chunk."""
    if not parts:
        raise ValueError("concat_rollouts: no chunks")
    rows = [len(p) for p in parts]
    total = sum(rows) or 1
    meta: dict[str, Any] = dict(parts[0].meta)
    for key in {k for p in parts for k in p.meta}:
        values = [p.meta[key] for p in parts if key in p.meta]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        if key == "response_tokens" or key.startswith(("timing/", "reshard/")):
            meta[key] = sum(values)
        elif key.startswith("memory/") or key == "response_length/max":
            meta[key] = max(values)
        elif key == "response_length/min":
            meta[key] = min(values)
        elif key in ("response_length/mean", "response_length/clip_ratio") and len(values) == len(parts):
            meta[key] = sum(v * r for v, r in zip(values, rows, strict=True)) / total
    return BatchHandle(tuple(s for p in parts for s in p.shards if s.rows), meta, tuple(parts))
