"""A vLLM rollout daemon (`generator = "vllm"`, vLLM's CPU build) beside a training actor, with
smollm2-135m: one versioned weight sync by handle with every bucket's checksum checked on arrival
(vLLM fuses and renames parameters, so what its engine holds is not re-read), a damaged bucket
named, and a rollout whose log-probs the actor recomputes on the same tokens."""

from __future__ import annotations

import pytest

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.wire.errors import RemoteError
from tests.support import local_cluster, skip_without_vllm

MODEL = "smollm2-135m"
VLLM = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20}


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_vllm_rollout_daemon_syncs_checks_and_generates() -> None:
    skip_without_vllm("vLLM rollout daemon test")
    daemons = [
        DaemonSpec("actor", impl="actor", options={"model": MODEL, "engine": {"micro_batch_size": 4}}),
        DaemonSpec("rollout", impl="rollout", options={"model": MODEL, "generator": "vllm", "vllm": VLLM}),
    ]
    async with local_cluster(daemons) as (ctl, _):
        actor, rollout = await ctl.role("actor", timeout_s=400), await ctl.role("rollout", timeout_s=400)
        [published] = await actor.publish_weights(0, bucket_mb=64, timeout_s=CALL_TIMEOUT_S)
        [loaded] = await rollout.load_weights(published, timeout_s=CALL_TIMEOUT_S)
        assert loaded["version"] == 0 and loaded["buckets"] == len(published["buckets"]) >= 2
        assert loaded["bytes"] == sum(b["nbytes"] for b in published["buckets"]) and loaded["held_verified"] == 0
        assert ctl.stats()["controller_bulk_bytes"] == 0

        prompts = prompts_handle({"prompt": ["The capital of France is", "2 + 2 ="]})
        out = await rollout.generate(prompts, n=2, max_new_tokens=8, temperature=0.8, seed=0, timeout_s=CALL_TIMEOUT_S)
        assert non_tensor(out, "weight_version") == [0] * 4 and all(t.strip() for t in non_tensor(out, "response"))
        # the actor recomputes the vLLM sampler's log-probs on the same tokens (fp32 CPU kernels)
        batch = await ctl.fetch(out)
        trained = await ctl.fetch(await actor.compute_log_prob(out, temperature=0.8, timeout_s=CALL_TIMEOUT_S))
        mask = batch["response_mask"].bool()
        assert float((batch["rollout_log_probs"] - trained["old_log_probs"])[mask].abs().max()) < 2e-3
        assert (batch["token_versions"][mask] == 0).all()

        [bad] = await actor.publish_weights(1, bucket_mb=64, corrupt_buckets=[1], timeout_s=CALL_TIMEOUT_S)
        with pytest.raises(RemoteError, match=r"weight sync to version 1: bucket 1 of \d+ \(.*\) arrived corrupted"):
            await rollout.load_weights(bad, timeout_s=CALL_TIMEOUT_S)
        with pytest.raises(RemoteError, match="holds no valid weights"):
            await rollout.generate(prompts, max_new_tokens=2, timeout_s=CALL_TIMEOUT_S)
