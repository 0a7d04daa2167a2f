"""Rebuilding tensors and Batches from fetched bytes in the controller (imports torch when used).

Only `Controller.fetch` uses this, on purpose and for small data; it knows handles and bytes.
"""

from __future__ import annotations

from typing import Any

from hfrt.protocols import BatchHandle, OutOfBand, Shard, TensorHandle


def tensor_from(buffer: OutOfBand, handle: TensorHandle) -> Any:
    import torch

    from hfrt.daemon.tensors.shmfile import to_dtype

    data = bytearray(buffer.buffer)
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(to_dtype(handle.dtype)).reshape((handle.num_rows, *handle.shape[1:]))


def batch_from(handle: BatchHandle, parts: list[tuple[Shard, list[OutOfBand]]]) -> Any:
    from hfrt.daemon.batch import Batch

    batches = [
        Batch({name: tensor_from(buf, h) for (name, h), buf in zip(shard.columns.items(), bufs, strict=True)}, shard.non_tensor)
        for shard, bufs in parts
    ]
    if not batches:
        return Batch(meta=handle.meta)
    merged = Batch.concat(batches) if len(batches) > 1 else batches[0]
    return Batch(merged.tensors, merged.non_tensor, handle.meta)
