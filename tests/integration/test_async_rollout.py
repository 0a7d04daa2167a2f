"""Disaggregated rollout on real daemons (tiny preset): a generation-only `rollout` role beside the
training actor, versioned weight sync by handle (no bytes through the controller), checksums per
bucket with a corrupted bucket named, and the `grpo_async` flow."""

from __future__ import annotations

from typing import Any

import pytest

from hfrt.deploy.base import DaemonSpec
from hfrt.errors import RemoteError
from hfrt.flows.common import CALL_TIMEOUT_S, non_tensor, prompts_handle
from tests.support import local_cluster

TRAIN = {"micro_batch_size": 32, "optim": {"lr": 2e-3}}
PROMPTS = {"prompt": ["1+1=", "2+0=", "0+1=", "2+2="], "ground_truth": ["2", "2", "1", "4"]}


def specs(rollout_ranks: int = 1) -> list[DaemonSpec]:
    return [
        DaemonSpec("actor", impl="actor", options={"model": "tiny", "engine": TRAIN}),
        *[DaemonSpec("rollout", rank, rollout_ranks, impl="rollout", options={"model": "tiny", "seed": 5})
          for rank in range(rollout_ranks)],
    ]


async def responses(group: Any, seed: int) -> list[list[Any]]:
    out = await group.generate(prompts_handle(PROMPTS), n=2, max_new_tokens=6, seed=seed, timeout_s=CALL_TIMEOUT_S)
    return [non_tensor(out, "response"), non_tensor(out, "weight_version") if "weight_version" in out.shards[0].non_tensor else []]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_sync_by_handle_versions_and_checksums() -> None:
    async with local_cluster(specs()) as (ctl, _):
        actor, rollout = await ctl.role("actor", timeout_s=60), await ctl.role("rollout", timeout_s=60)
        assert await rollout.weight_version() == [-1]
        [_, versions] = await responses(rollout, seed=1)
        assert versions == [-1] * 8
        [published] = await actor.publish_weights(0, bucket_mb=0.05)
        assert len(published["buckets"]) > 2  # bucketed
        [loaded] = await rollout.load_weights(published, timeout_s=CALL_TIMEOUT_S)
        assert loaded["version"] == 0 and loaded["buckets"] == len(published["buckets"])
        assert loaded["held_verified"] == loaded["buckets"] and loaded["bytes"] > 0
        # the rollout daemon now samples exactly what the actor samples (its own seed-5 weights are gone)
        [texts, versions] = await responses(rollout, seed=3)
        [actor_texts, _] = await responses(actor, seed=3)
        assert texts == actor_texts and versions == [0] * 8
        assert ctl.stats()["controller_bulk_bytes"] == 0  # buckets moved daemon to daemon

        # a bucket damaged after the trainer's checksum is detected and named; no generation until fixed
        [bad] = await actor.publish_weights(1, bucket_mb=0.05, corrupt_buckets=[1])
        count = len(bad["buckets"])
        with pytest.raises(RemoteError, match=rf"rollout daemon rollout:0: weight sync to version 1: bucket 1 of {count} \(.*\) arrived corrupted"):
            await rollout.load_weights(bad, timeout_s=CALL_TIMEOUT_S)
        with pytest.raises(RemoteError, match="rollout:0 holds no valid weights: .*bucket 1"):
            await responses(rollout, seed=3)
        [good] = await actor.publish_weights(2, bucket_mb=0.05)
        await rollout.load_weights(good, timeout_s=CALL_TIMEOUT_S)
        assert await rollout.weight_version() == [2]
        assert ctl.stats()["controller_bulk_bytes"] == 0
