"""Weight-sync packing and checksums (pure tensor logic, no processes): buckets round-trip, the
checksum sees one flipped byte and swapped words, and apply_sync names the corrupted bucket."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hfrt.roles.components.weight_sync import WeightSyncError, apply_sync, bucket_checksum, pack_buckets, unpack


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 8, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16),
            "c": torch.arange(7, dtype=torch.int64)}


def test_buckets_round_trip_whole_tensors() -> None:
    w = weights()
    buckets = list(pack_buckets([{"a": w["a"]}, {"b": w["b"], "c": w["c"]}], bucket_bytes=100))
    assert [[row[0] for row in layout] for _, layout in buckets] == [["a"], ["b"], ["c"]]
    back = {name: t for flat, layout in buckets for name, t in unpack(flat, layout)}
    for name, tensor in w.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)


def test_checksum_sees_a_flipped_byte_and_swapped_words() -> None:
    flat = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8)
    base = bucket_checksum(flat)
    assert base == bucket_checksum(flat.clone())
    flipped = flat.clone()
    flipped[12345] ^= 1
    assert bucket_checksum(flipped) != base
    swapped = flat.clone().view(torch.int32)
    swapped[0], swapped[1] = 1, 2
    base = bucket_checksum(swapped.view(torch.uint8))
    swapped[[0, 1]] = swapped[[1, 0]]
    assert bucket_checksum(swapped.view(torch.uint8)) != base
    assert bucket_checksum(torch.zeros(5, dtype=torch.uint8)) == bucket_checksum(torch.zeros(8, dtype=torch.uint8))


def record(w: dict[str, torch.Tensor], corrupt: int | None = None) -> dict[str, Any]:
    buckets = []
    for index, (flat, layout) in enumerate(pack_buckets([w], bucket_bytes=100)):
        entry = {"index": index, "layout": layout, "checksum": bucket_checksum(flat), "nbytes": flat.numel()}
        if index == corrupt:
            flat[0] ^= 0xFF
        buckets.append(entry | {"data": flat})
    return {"version": 3, "buckets": buckets}


def test_apply_sync_names_the_corrupted_bucket() -> None:
    w, got = weights(), {}
    result = apply_sync(record(w), lambda t: t, lambda pairs: got.update(pairs), lambda layout: None, "rollout:0")
    assert result["version"] == 3 and result["buckets"] == 3 and set(got) == set(w)
    with pytest.raises(WeightSyncError, match=r"rollout:0: weight sync to version 3: bucket 1 of 3 \(b; 600 bytes\) arrived corrupted"):
        apply_sync(record(w, corrupt=1), lambda t: t, lambda pairs: list(pairs), lambda layout: None, "rollout:0")


def test_apply_sync_checks_what_the_engine_holds() -> None:
    w = weights()

    def held(layout: list[list[Any]]) -> torch.Tensor:
        return torch.zeros(sum(row[4] for row in layout), dtype=torch.uint8)  # an engine that dropped everything

    with pytest.raises(WeightSyncError, match="after loading, the engine's bucket 0 of 3"):
        apply_sync(record(w), lambda t: t, lambda pairs: list(pairs), held, "rollout:0")
