"""Versioned, bucketed weight sync from a trainer's ranks to generation-only daemons, daemon side.

The publisher (a trainer rank's `publish_weights` endpoint, via `publish`) packs the full weights
(with LoRA on the trainer: the adapter tensors only, and the record says so under "adapter"), one
bucket of whole tensors at a time, into flat byte buffers that stay in its tensor store; the flow
passes their handles on, and each receiver pulls them daemon-to-daemon (shm / gloo on CPU, CUDA
IPC / NCCL on GPU), checks every bucket's checksum on the bytes it received and again on what its
engine holds, and loads them (`apply_sync`). The checksum is device-independent (the same value
on CPU and GPU). It knows tensors, names and checksums; nothing of flows, losses or the wire.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

#: words per checksum chunk: 65536 int32 words × weights < 2^16 keep each chunk's sum below 2^63
_CHUNK = 1 << 16
_MOD = (1 << 61) - 1


class WeightSyncError(RuntimeError):
    """A sync could not be applied: the message names the version, the bucket and its tensors."""


def bucket_checksum(flat: torch.Tensor) -> int:
    """A position-sensitive checksum of a flat uint8 buffer, equal on every device: int32 words
    weighted by their position in each chunk, chunk sums combined as a polynomial mod 2^61 − 1."""
    data = flat.reshape(-1).view(torch.uint8)
    pad = (-data.numel()) % (4 * _CHUNK)
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    words = data.view(torch.int32).view(-1, _CHUNK)
    weights = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=data.device)
    sums: list[int] = []
    for start in range(0, words.shape[0], 256):  # at most 128 MiB of int64 temporaries at once
        part = words[start : start + 256].to(torch.int64)
        sums.extend(int(v) for v in (part * weights).sum(dim=1).cpu().tolist())
    total = 0
    for value in sums:
        total = (total * 1_000_003 + value) % _MOD
    return total


def pack_buckets(
    stream: Iterable[dict[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[torch.Tensor, list[list[Any]]]]:
    """(flat uint8 buffer, layout) per bucket: whole tensors in stream order until the bucket holds
    at least `bucket_bytes`. Layout rows: [name, dtype, shape, byte offset, nbytes]."""
    parts: list[torch.Tensor] = []
    layout: list[list[Any]] = []
    size = 0
    for block in stream:
        for name, tensor in block.items():
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()
            layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), size, raw.numel()])
            parts.append(raw)
            size += raw.numel()
            if size >= bucket_bytes:
                yield torch.cat(parts), layout
                parts, layout, size = [], [], 0
    if parts:
        yield torch.cat(parts), layout


def unpack(flat: torch.Tensor, layout: list[list[Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one bucket (views of `flat`)."""
    for name, dtype, shape, offset, nbytes in layout:
        piece = flat[offset : offset + nbytes].view(getattr(torch, dtype))
        yield name, piece.view(shape)


def describe_bucket(index: int, count: int, layout: list[list[Any]]) -> str:
    names = [row[0] for row in layout]
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")
    return f"bucket {index} of {count} ({shown}; {sum(row[4] for row in layout)} bytes)"


def publish(
    engine: Any, rank: int, version: int, bucket_mb: float = 64.0, corrupt_buckets: list[int] | None = None
) -> dict[str, Any]:
    """What a trainer's `publish_weights` endpoint returns: the current full weights of `engine` (a
    training engine) packed into buckets of about `bucket_mb` MiB, kept by rank 0 (every rank
    takes part in gathering), with a checksum each. `corrupt_buckets` flips one byte of those
    buckets after their checksum is taken (fault injection for tests: the receiver must name them)."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"publish_weights: version must be an int >= 0, got {version!r}")
    if not bucket_mb > 0:
        raise ValueError(f"publish_weights: bucket_mb must be > 0, got {bucket_mb!r}")
    start = time.perf_counter()
    buckets: list[dict[str, Any]] = []
    spec = getattr(engine, "lora", None)
    extra = {} if spec is None else {"adapter": spec.record()}  # LoRA: the adapters only (roles/generation/lora.py)
    if rank != 0:  # take part in gathering (collective on sharded backends), keep nothing
        for _ in _published(engine):
            pass
        return {"version": version, "buckets": buckets, "timing/publish_s": time.perf_counter() - start} | extra
    for index, (flat, layout) in enumerate(pack_buckets(_published(engine), int(bucket_mb * 2**20))):
        record = {"index": index, "layout": layout, "checksum": bucket_checksum(flat), "nbytes": flat.numel()}
        if corrupt_buckets and index in corrupt_buckets:
            flat[flat.numel() // 2] ^= 0xFF
        buckets.append(record | {"data": flat})
    return {"version": version, "buckets": buckets, "timing/publish_s": time.perf_counter() - start} | extra


def _published(engine: Any) -> Iterator[dict[str, torch.Tensor]]:
    """What a version holds: the full weights, or with LoRA (engine.lora) only the adapter tensors,
    under PEFT's saved names, which a receiver built with the same options.lora loads."""
    if getattr(engine, "lora", None) is None:
        return engine.state_dict_for_generation()
    from hfrt.roles.generation.lora import adapter_tensors

    return adapter_tensors(engine)


def apply_sync(
    sync: dict[str, Any],
    pull: Callable[[Any], torch.Tensor],
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
    held: Callable[[list[list[Any]]], torch.Tensor | None],
    where: str,
) -> dict[str, Any]:
    """Pull, check and load one published version: `load` gets one stream of (name, tensor) that
    pulls and checks a bucket at a time (one bucket in memory at once); afterwards each bucket's
    checksum is taken again on what the engine holds.

    `pull(handle)` fetches a bucket's bytes, `load(pairs)` copies tensors into the engine and
    `held(layout)` re-packs what the engine now holds for that layout (None: cannot read back).
    Raises WeightSyncError naming `where`, the version and the bucket whose checksum differs."""
    version, buckets = sync.get("version"), sync.get("buckets")
    if not isinstance(version, int) or not isinstance(buckets, list) or not buckets:
        raise WeightSyncError(f"{where}: a sync record needs an int version and a non-empty bucket list")
    start, received = time.perf_counter(), [0]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in buckets:
            flat = pull(bucket["data"]).reshape(-1).view(torch.uint8)
            received[0] += flat.numel()
            got = bucket_checksum(flat)
            if got != bucket["checksum"]:
                raise WeightSyncError(
                    f"{where}: weight sync to version {version}: "
                    f"{describe_bucket(bucket['index'], len(buckets), bucket['layout'])} arrived corrupted "
                    f"(checksum {got:#x}, the trainer's {bucket['checksum']:#x}); the rollout holds no valid weights"
                )
            yield from unpack(flat, bucket["layout"])

    load(stream())
    verified = 0
    for bucket in buckets:
        again = held(bucket["layout"])
        if again is None:
            continue
        got = bucket_checksum(again)
        if got != bucket["checksum"]:
            raise WeightSyncError(
                f"{where}: weight sync to version {version}: after loading, the engine's "
                f"{describe_bucket(bucket['index'], len(buckets), bucket['layout'])} has checksum {got:#x}, "
                f"the trainer's {bucket['checksum']:#x}"
            )
        verified += 1
    return {
        "version": version, "bytes": received[0], "buckets": len(buckets), "held_verified": verified,
        "timing/load_s": time.perf_counter() - start,
    }
