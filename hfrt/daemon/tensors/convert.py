"""Endpoint values ⇄ wire values on a daemon: tensors and Batches leave as handles, handles arrive as tensors.

`export` stores every tensor of a result in the daemon's TensorStore and puts a TensorHandle (or,
for a Batch, a one-shard BatchHandle) in its place; 0-d tensors become Python numbers, and tensors
of at most `inline_max_bytes` travel inline as nested lists. `resolve` does the reverse for call
arguments, pulling each shard's rows from its owner. It knows the store and the peers, not the
endpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from hfrt.daemon.batch import Batch
from hfrt.daemon.tensors.peers import Peers
from hfrt.daemon.tensors.store import TensorStore
from hfrt.protocols import BatchHandle, Shard, TensorHandle


def export(value: Any, store: TensorStore, inline_max_bytes: int = 0) -> Any:
    """The wire form of an endpoint's return value."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.item()
        if value.numel() * value.element_size() <= inline_max_bytes:
            return value.tolist()
        return store.put(value)
    if isinstance(value, Batch):
        columns = {name: store.put(t) for name, t in value.tensors.items()}
        shard = Shard(store.owner, len(value), columns, {k: list(v) for k, v in value.non_tensor.items()})
        return BatchHandle((shard,), export(dict(value.meta), store, inline_max_bytes))
    if isinstance(value, dict):
        return {k: export(v, store, inline_max_bytes) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [export(v, store, inline_max_bytes) for v in value]
    return value


def resolve(value: Any, peers: Peers) -> Any:
    """Call arguments with every handle replaced by its tensor (rows pulled from the owners)."""
    if isinstance(value, BatchHandle):
        return _batch(value, peers)
    if isinstance(value, TensorHandle):
        return peers.pull([value])[0]
    if isinstance(value, dict):
        return {k: resolve(v, peers) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, peers) for v in value]
    return value


def _batch(handle: BatchHandle, peers: Peers) -> Batch:
    names = handle.keys()
    wanted = [h for shard in handle.shards for h in (shard.columns[n] for n in names)]
    tensors = peers.pull(wanted) if wanted else []
    parts, i = [], 0
    for shard in handle.shards:
        if set(shard.columns) != set(names):
            raise ValueError(f"batch shards disagree on columns: {sorted(shard.columns)} vs {sorted(names)}")
        cols = dict(zip(names, tensors[i : i + len(names)], strict=True))
        i += len(names)
        parts.append(Batch(cols, shard.non_tensor))
    if not parts:
        return Batch(meta=handle.meta)
    merged = Batch.concat(parts) if len(parts) > 1 else parts[0]
    return Batch(merged.tensors, merged.non_tensor, handle.meta)


def contains_handles(value: Any) -> bool:
    if isinstance(value, (TensorHandle, BatchHandle)):
        return True
    if isinstance(value, dict):
        return any(contains_handles(v) for v in value.values())
    if isinstance(value, list):
        return any(contains_handles(v) for v in value)
    return False
