"""Batches the controller makes and reads itself: a batch of prompts carried inline (no daemon owns
it) and the non-tensor columns of a batch handle.

No torch and no bytes: it handles BatchHandle records only; it never pulls a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfrt.protocols import BatchHandle


def prompts_handle(columns: Mapping[str, list[Any]]) -> BatchHandle:
    """A batch of non-tensor columns made in the controller: one shard that no daemon owns, so the
    receiving ranks read their rows straight out of the handle."""
    return BatchHandle.inline(dict(columns))


def non_tensor(handle: BatchHandle, name: str) -> list[Any]:
    """A non-tensor column of a batch handle (carried inline in its shards: no bytes move)."""
    return [value for shard in handle.shards for value in shard.non_tensor.get(name, [])]
