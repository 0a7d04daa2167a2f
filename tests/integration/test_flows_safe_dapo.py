"""The safe_rlhf and dapo flows: end to end through `hfrt controller` on real daemons (2 steps,
metrics.jsonl, no tensor bytes through the controller, λ following its update rule, DAPO's kept
groups), and without daemons: the λ update and its checkpoint state, the cost function, group
selection as row ranges over batch handles, the overlong penalty and the cost-shaped advantages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfrt.daemon.batch import Batch
from hfrt.flows.recipes.dapo import DAPOConfig, coalesce, group_ranges, merged_rollout_meta, select_rows, varied_groups
from hfrt.flows.recipes.safe_rlhf import LagrangeMultiplier, SafeRLHFConfig
from hfrt.flows.tasks import addition_cost
from hfrt.protocols import BatchHandle
from hfrt.protocols.handles import Shard, TensorHandle
from hfrt.roles.components.advantage import Advantages, overlong_penalty

from .test_flows import run_flow


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_safe_rlhf_two_steps_lambda_follows_mean_cost(tmp_path: Path) -> None:
    # kl_coef=0: the policy's token rewards are then exactly reward − λ·cost
    summary = run_flow("safe_rlhf", tmp_path / "run", "steps=2", "kl_coef=0", "cost_limit=0.25", "lambda_lr=0.5")
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [0, 1]
    lam = 1.0  # lambda_init
    for r in recs:
        for key in ("reward/mean", "kl/mean", "cost/mean", "safe/lambda", "timing/step_s", "critic/loss", "timing/cost_s"):
            assert key in r, key
        assert r["controller_bulk_bytes"] == 0 and 0.0 <= r["cost/mean"] <= 1.0
        lam = max(0.0, lam + 0.5 * (r["cost/mean"] - 0.25))
        assert r["safe/lambda"] == pytest.approx(lam)
        # the actor's advantages saw reward − λ·cost (daemon side, from the cost role's column)
        assert r["reward/token_sum_mean"] == pytest.approx(r["reward/mean"] - lam * r["cost/mean"], abs=1e-5)
        assert r["cost/token_sum_mean"] == pytest.approx(r["cost/mean"], abs=1e-6)
    assert recs[0]["safe/lambda"] != 1.0  # a random policy's cost is far from the limit


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dapo_two_steps_keeps_only_groups_with_varied_rewards(tmp_path: Path) -> None:
    summary = run_flow("dapo", tmp_path / "run", "steps=2", "prompts_per_step=4", "n=4", "max_gen_batches=4")
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        for key in ("reward/mean", "timing/step_s", "actor/pg_loss", "dapo/overlong_penalty_mean", "advantages/mean"):
            assert key in r, key
        assert "kl/mean" in r and "actor/kl_loss" not in r  # KL logged, not in the loss (kl_loss_coef 0)
        assert r["controller_bulk_bytes"] == 0
        assert 0 < r["dapo/kept_groups"] <= 4 and 1 <= r["dapo/gen_batches"] <= 4
        assert r["dapo/generated_groups"] == 4 * r["dapo/gen_batches"]
        assert r["dapo/kept_groups"] == 4 or r["dapo/gen_batches"] == 4  # stop early only when full
        assert r["dapo/kept_min_group_std"] > 0  # no kept group scored all alike
        # the daemon trained on the kept rows: its score sums are their rewards plus the penalty
        want = r["dapo/kept_reward_mean"] + r["dapo/overlong_penalty_mean"]
        assert r["reward/token_sum_mean"] == pytest.approx(want, abs=1e-5)
        assert -1.0 <= r["dapo/overlong_penalty_mean"] <= 0.0


# -- Safe-RLHF pieces -------------------------------------------------------------------------


def test_lagrange_multiplier_update_and_state() -> None:
    lam = LagrangeMultiplier(1.0, lr=0.5, limit=0.2)
    assert lam.update(0.6) == pytest.approx(1.2)  # 1 + .5·(.6 − .2)
    assert lam.update(0.0) == pytest.approx(1.1)  # 1.2 + .5·(0 − .2)
    assert LagrangeMultiplier(0.05, lr=0.5, limit=0.2).update(0.0) == 0.0  # projected onto λ ≥ 0
    resumed = LagrangeMultiplier(1.0, lr=0.5, limit=0.2)
    resumed.load_state_dict(json.loads(json.dumps(lam.state_dict())))
    assert resumed.value == pytest.approx(1.1) and resumed.update(0.2) == pytest.approx(1.1)


def test_addition_cost_and_config() -> None:
    assert [addition_cost(r, "4") for r in ("4", "3", "", "44", "4 ", "x", "4=")] == [0, 0, 1, 1, 1, 1, 1]
    assert addition_cost("12", 12) == 0.0 and addition_cost("123", "12") == 1.0
    assert SafeRLHFConfig.read({"cost_limit": 0}).cost_limit == 0.0
    with pytest.raises(ValueError, match="lambda_lr"):
        SafeRLHFConfig.read({"lambda_lr": -1.0})


def test_compute_advantages_subtracts_weighted_costs() -> None:
    mask = torch.tensor([[1, 1], [1, 0]])
    scores = Batch({"token_level_scores": torch.tensor([[0.0, 1.0], [0.5, 0.0]]), "response_mask": mask})
    costs = Batch({"token_level_costs": torch.tensor([[0.0, 1.0], [0.0, 0.0]])})
    out = Advantages().compute(
        scores, costs, Batch({"values": torch.zeros(2, 2)}), estimator="gae", cost_column="token_level_costs", cost_coef=1.5)
    assert out["token_level_rewards"].flatten().tolist() == pytest.approx([0.0, -0.5, 0.5, 0.0])
    assert out.meta["metrics"]["cost/token_sum_mean"] == pytest.approx(0.5)


# -- DAPO pieces ------------------------------------------------------------------------------


def test_group_filter_keeps_row_ranges_of_varied_groups() -> None:
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    scores = [1.0, 0.0, 0.1, 0.1, 0.0, 1.0, 0.0, 0.0]
    groups = group_ranges(uids)
    assert groups == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert varied_groups(scores, groups) == [(0, 2), (4, 6)]
    assert coalesce([(4, 6), (0, 2), (2, 4), (7, 8)]) == [(0, 6), (7, 8)]
    with pytest.raises(ValueError, match="not in adjacent rows"):
        group_ranges(["a", "b", "a"])


def _handle(owner: str, rows: int, first: int) -> BatchHandle:
    column = TensorHandle(owner, f"{owner}/scores", (rows, 4), "float32", "cpu", rows * 16)
    return BatchHandle((Shard(owner, rows, {"scores": column}, {"row": list(range(first, first + rows))}),))


def test_select_rows_slices_across_shards_without_bytes() -> None:
    batch = BatchHandle.concat([_handle("actor:0", 4, 0), _handle("actor:1", 4, 4)])
    picked = select_rows(batch, [(6, 8), (0, 2), (2, 4)])  # groups 0 and 1 join into one range
    assert [s.owner for s in picked.shards] == ["actor:0", "actor:1"]
    assert [s.non_tensor["row"] for s in picked.shards] == [[0, 1, 2, 3], [6, 7]]
    assert picked.shards[1].columns["scores"].rows == (2, 4)  # rows of actor:1's stored tensor
    assert len(picked) == 6 and picked.nbytes == 6 * 16


def test_merged_rollout_meta_adds_times_and_weights_means() -> None:
    a = BatchHandle.inline({"x": [0] * 2}, {"timing/gen_s": 1.0, "response_tokens": 4.0, "response_length/mean": 2.0,
                                             "response_length/max": 2.0, "response_length/min": 2.0, "temperature": 1.0})
    b = BatchHandle.inline({"x": [0] * 6}, {"timing/gen_s": 2.0, "response_tokens": 24.0, "response_length/mean": 4.0,
                                             "response_length/max": 4.0, "response_length/min": 4.0, "temperature": 1.0})
    meta = merged_rollout_meta([a, b])
    assert meta["timing/gen_s"] == 3.0 and meta["response_tokens"] == 28.0 and meta["response_length/mean"] == 3.5
    assert (meta["response_length/max"], meta["response_length/min"], meta["temperature"]) == (4.0, 2.0, 1.0)


def test_overlong_penalty_by_hand() -> None:
    # M = 4, L = 2: lengths up to 2 are free, 3 costs 1/2 · factor, 4 costs 2/2 · factor
    got = overlong_penalty(torch.tensor([0, 2, 3, 4]), max_len=4, buffer_len=2, factor=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5, factor=1.0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    rollout = Batch({"response_mask": mask, "token_level_scores": torch.zeros(2, 4)}, {"uid": ["a", "a"]})
    out = Advantages().compute(
        rollout, estimator="grpo", overlong_buffer_len=2, overlong_penalty_factor=1.0, max_response_len=4)
    assert out["token_level_rewards"].flatten().tolist() == pytest.approx([0, 0, -0.5, 0, 0, 0, 0, -1.0])
    assert out.meta["metrics"]["overlong/penalty_mean"] == pytest.approx(-0.75)


def test_dapo_config_defaults_and_checks() -> None:
    cfg = DAPOConfig.read({})
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.kl_loss_coef, cfg.loss_agg_mode) == (0.2, 0.28, 0.0, "token-mean")
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        DAPOConfig.read({"overlong_buffer_len": 5})
    with pytest.raises(ValueError, match="groups of at least 2"):
        DAPOConfig.read({"n": 1})


def test_safe_rlhf_and_dapo_import_no_torch() -> None:
    code = "import sys, hfrt.flows.recipes.safe_rlhf, hfrt.flows.recipes.dapo; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
