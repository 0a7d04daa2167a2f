"""Partial rollouts on real daemons (tiny preset): `rollout.generate_partial` in segments, a weight
sync between segments resuming the unfinished rows with the new version (per-token versions, the
sampler's own log-probs), one segment of K ≥ max_new_tokens equal to `generate`, and `grpo_async`
with `partial_rollout_tokens` running to the end with rows that span two versions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S
from tests.support import local_cluster

TRAIN = {"micro_batch_size": 32, "optim": {"lr": 2e-3}}
PROMPTS = {"prompt": ["1+1=", "2+0=", "0+1=", "2+2="], "ground_truth": ["2", "2", "1", "4"], "uid": ["a", "b", "c", "d"]}
SAMPLING = {"n": 2, "max_new_tokens": 6, "seed": 3, "ignore_eos": True}


def specs() -> list[DaemonSpec]:
    return [DaemonSpec("actor", impl="actor", options={"model": "tiny", "engine": TRAIN}),
            DaemonSpec("rollout", impl="rollout", options={"model": "tiny", "seed": 5})]


async def sync_version(actor: Any, rollout: Any, version: int) -> None:
    [published] = await actor.publish_weights(version, bucket_mb=1)
    await rollout.load_weights(published, timeout_s=CALL_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_sync_between_segments_resumes_rows_with_the_new_version() -> None:
    async with local_cluster(specs()) as (ctl, _):
        actor, rollout = await ctl.role("actor", timeout_s=60), await ctl.role("rollout", timeout_s=60)
        prompts = prompts_handle(PROMPTS)
        await sync_version(actor, rollout, 0)
        whole = await rollout.generate(prompts, **SAMPLING, timeout_s=CALL_TIMEOUT_S)
        for k in (6, 50):  # one segment of K >= max_new_tokens is `generate`, column for column
            one = await rollout.generate_partial(prompts, key=f"k{k}", segment_tokens=k, **SAMPLING, timeout_s=CALL_TIMEOUT_S)
            assert one.meta["segments"] == 1
            a, b = await ctl.fetch(whole), await ctl.fetch(one)
            assert set(a.tensors) == set(b.tensors) and "token_versions" in a.tensors
            for name in a.tensors:
                assert torch.equal(a[name], b[name]), name
            assert non_tensor(whole, "response") == non_tensor(one, "response")

        # segments of 2 tokens; version 1 is synced after the first one (same weights, new number)
        bulk = ctl.stats()["controller_bulk_bytes"]  # (the fetches above are counted, on purpose)
        first = await rollout.generate_partial(prompts, key="s", segment_tokens=2, **SAMPLING, timeout_s=CALL_TIMEOUT_S)
        assert first.meta["unfinished"] == 8 and non_tensor(first, "finished") == [False] * 8
        await sync_version(actor, rollout, 1)
        out = first
        while "unfinished" in out.meta:
            out = await rollout.generate_partial(prompts, key="s", segment_tokens=2, **SAMPLING, timeout_s=CALL_TIMEOUT_S)
        assert ctl.stats()["controller_bulk_bytes"] == bulk  # segments and sync: handles and ids only
        batch = await ctl.fetch(out)
        assert out.meta["segments"] == 3 and batch["token_versions"].tolist() == [[0, 0, 1, 1, 1, 1]] * 8
        assert non_tensor(out, "weight_version") == [0] * 8 and non_tensor(out, "weight_version_max") == [1] * 8
        assert out.meta["weight_version"] == 0  # the oldest token's
        # token-in continuation: the sampler's log-probs are the policy's on exactly these tokens
        trained = await ctl.fetch(await actor.compute_log_prob(out, timeout_s=CALL_TIMEOUT_S))
        assert torch.allclose(batch["rollout_log_probs"], trained["old_log_probs"], atol=1e-4)

        # a later segment for a key the daemon does not hold (its rows were lost with a replaced
        # daemon; recovery re-sends the call): the whole rollout again, to the end, in one call
        lost = await rollout.generate_partial(
            prompts, key="gone", segment_tokens=2, segment=2, **SAMPLING, timeout_s=CALL_TIMEOUT_S
        )
        assert "unfinished" not in lost.meta and lost.meta["regenerated"] is True and lost.meta["segments"] == 3
        again = await ctl.fetch(lost)
        assert again["responses"].shape == batch["responses"].shape and "response_mask" in again.tensors
        assert again["token_versions"].tolist() == [[1] * 6] * 8  # all with the weights held now


def run_cli(run_dir: Path, *sets: str) -> list[dict[str, Any]]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo_async", "--run-dir", str(run_dir),
            "--set", "progress=off", "--set", "export_hf=false"]
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_grpo_async_with_partial_rollouts_spans_versions_and_finishes(tmp_path: Path) -> None:
    rows = run_cli(tmp_path / "run", "steps=4", "max_staleness=1", "partial_rollout_tokens=2", "max_new_tokens=32",
                   "policy_loss_mode=decoupled", "tis_cap=2")
    assert len(rows) == 4
    for r in rows:
        assert r["async/staleness_max"] <= 1 and r["async/partial_segments"] >= 1 and r["controller_bulk_bytes"] == 0
        assert "actor/behav_kl" in r
    # rollouts 2 and 3 start on the version before theirs and, generation (16 segments) being the
    # slower side, are still running when the next version is synced: resumed with it
    assert max(r["async/rows_spanning_versions"] for r in rows[2:]) > 0, [r["async/rows_spanning_versions"] for r in rows]
