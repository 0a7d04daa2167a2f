"""The policy loss modes on real daemons: `hfrt controller --flow grpo` trains with GSPO, with
CISPO under truncated importance sampling, and with an optimal token baseline, Clip-Cov and the
rollout correction picked by `--set`; bad loss options end the controller with exit 2 before any
daemon starts; hfrt.wire.loss_options imports no torch (the controller reads it)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_flows import run_flow


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grpo_trains_with_gspo_and_with_cispo_under_tis(tmp_path: Path) -> None:
    runs = {
        "gspo": ("policy_loss_mode=gspo", "loss_agg_mode=seq-mean-token-mean"),
        "cispo_tis": ("policy_loss_mode=cispo", "tis_cap=2", "actor_loss.clip_ratio_high=0.28"),
    }
    for name, sets in runs.items():
        summary = run_flow("grpo", tmp_path / name, "steps=2", "prompts_per_step=4", "n=4", *sets)
        assert summary["steps"] == 2
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1]
        for record in records:
            for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
                assert math.isfinite(record[key]), (name, key)
            assert record["actor/grad_norm"] > 0
            assert "actor/pg_clipfrac_lower" not in record  # vanilla's dual clip only: not the vanilla loss
            assert ("actor/tis_weight_mean" in record) == (name == "cispo_tis")
    # the sampler and the trainer share weights here: every TIS weight is about 1, none truncated
    last = [json.loads(line) for line in (tmp_path / "cispo_tis" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["actor/tis_weight_mean"] == pytest.approx(1.0, abs=0.05) and last["actor/tis_truncated_frac"] < 0.05


def test_controller_refuses_bad_loss_options_before_any_daemon_starts(tmp_path: Path) -> None:
    for item, wanted in (
        ("actor_loss.bogus=1", "unknown option(s) ['bogus']; accepted: "),
        ("policy_loss_mode=ppo", "use one of vanilla, gspo, cispo"),
        ("kl_loss_type=k9", "kl_loss_type='k9'"),
    ):
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(tmp_path / "r"), "--set", item],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert wanted in out.stderr and "ppo_mini_batch_size" in out.stderr and "micro_batch_size" in out.stderr
        assert time.monotonic() - start < 30 and not (tmp_path / "r").exists()  # no daemon, no run folder


def test_loss_options_import_no_torch() -> None:
    code = "import sys, hfrt.wire.loss_options, hfrt.flows.recipes.grpo, hfrt.flows.recipes.ppo; assert 'torch' not in sys.modules, 'torch'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_with_an_optimal_token_baseline_clip_cov_and_rollout_correction(tmp_path: Path) -> None:
    """`--set` picks verl's newer estimator and loss on real daemons: the optimal token baseline
    (the actor's log-prob pass then computes Σπ²), Clip-Cov seeded, and the decoupled rollout
    correction (sequence IS weights, token rejection) prepared in the actor before its update."""
    sets = ("advantage.estimator=optimal_token_baseline", "policy_loss_mode=clip_cov", "actor_loss.clip_cov_lb=-10",
            "actor_loss.loss_seed=3", "actor_loss.rollout_is=sequence", "actor_loss.rollout_rs=token_k1",
            "actor_loss.rollout_rs_threshold=0.5_2")
    summary = run_flow("grpo", tmp_path / "run", "steps=2", "prompts_per_step=4", "n=4", *sets)
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert math.isfinite(record["actor/pg_loss"]) and record["actor/grad_norm"] > 0
        assert "timing/old_log_prob_s" in record  # the Σπ² pass runs although the update is one step
        # sampler and trainer share weights: weights about 1, nothing rejected; Clip-Cov cut a token
        assert record["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.1)
        assert record["rollout_corr/rollout_rs_masked_fraction"] < 0.05 and math.isfinite(record["rollout_corr/kl"])
        assert record["actor/pg_clipfrac"] > 0
