"""The critic-free REINFORCE family of built-in flows — `rloo`, `reinforce_pp` (and its baseline
variant), `remax` — run through `hfrt controller` on real local daemons for two steps; plus their
config checks and ReMax's controller-side baseline column, on hand-computed cases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.grpo_family import RLOOConfig, actor_loss_options
from hfrt.flows.recipes.reinforce_pp import ReinforcePPConfig
from hfrt.flows.recipes.remax import BASELINE, ReMaxConfig, baseline_column, baseline_handle, keyed_prompts
from hfrt.protocols import BatchHandle
from hfrt.protocols.handles import Shard, TensorHandle
from tests.integration.test_flows import run_flow

REQUIRED = ("reward/mean", "kl/mean", "timing/step_s", "advantages/mean", "timing/generate_s",
            "timing/stage2_s", "timing/advantages_s", "timing/update_s", "actor/pg_loss")


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "sets"), [
    ("rloo", ()), ("reinforce_pp", ()), ("reinforce_pp", ("baseline=true", "n=4")), ("remax", ()),
])
def test_family_flow_runs_two_steps_on_real_daemons(name: str, sets: tuple[str, ...], tmp_path: Path) -> None:
    summary = run_flow(name, tmp_path / "run", "steps=2", *sets)
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        missing = [k for k in REQUIRED if k not in record]
        assert not missing, missing
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["controller_bulk_bytes"] == 0
        # KL in the reward at the default coefficient, no KL loss term
        assert record["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
        assert "actor/kl_loss" not in record
    if name == "remax":
        for record in records:
            assert 0.0 <= record["remax/baseline_mean"] <= 1.0
            # the greedy call was sent with the sampled one and came back after it (queued behind
            # it on the actor), so it was in flight while the samples' stage 2 ran
            assert record["timing/greedy_generate_s"] > record["timing/generate_s"]
            assert record["timing/rollout_s"] >= record["timing/greedy_generate_s"]


def test_family_flows_import_no_torch() -> None:
    code = ("import sys, hfrt.flows.recipes.rloo, hfrt.flows.recipes.reinforce_pp, hfrt.flows.recipes.remax; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_family_configs_pick_estimator_and_kl() -> None:
    rloo = RLOOConfig.read({})
    assert rloo.advantage_options()["estimator"] == "rloo" and rloo.advantage_options()["use_kl_in_reward"] is True
    assert actor_loss_options(rloo)["use_kl_loss"] is False
    assert RLOOConfig.read({"kl_coef": 0.0}).advantage_options()["use_kl_in_reward"] is False
    rpp = ReinforcePPConfig.read({"gamma": 0.9})
    assert rpp.n == 1 and rpp.advantage_options()["estimator"] == "reinforce_plus_plus"
    assert rpp.advantage_options()["gamma"] == 0.9
    base = ReinforcePPConfig.read({"baseline": True, "n": 4}).advantage_options()
    assert base["estimator"] == "reinforce_plus_plus_baseline" and "gamma" not in base
    remax = ReMaxConfig.read({}).advantage_options()
    assert remax["estimator"] == "remax" and remax["baseline_column"] == BASELINE == "baseline_score"


def test_family_configs_reject_bad_settings() -> None:
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline compares a prompt's samples"):
        ReinforcePPConfig.read({"baseline": True})
    with pytest.raises(ValueError, match="rloo compares"):
        RLOOConfig.read({"n": 1})
    with pytest.raises(ValueError, match="norm_adv_by_std is GRPO's"):
        ReMaxConfig.read({"norm_adv_by_std": False})
    with pytest.raises(ValueError, match="kl_ctrl"):
        ReinforcePPConfig.read({"kl_ctrl": "pid"})


def test_baseline_column_by_uid() -> None:
    # two prompts, two samples each; the greedy rollout lists the prompts in another order
    samples = ["0:0", "0:0", "0:1", "0:1"]
    assert baseline_column(samples, ["0:1", "0:0"], [1.0, 0.1]) == [0.1, 0.1, 1.0, 1.0]
    with pytest.raises(ValueError, match="have no greedy response"):
        baseline_column(samples, ["0:0"], [1.0])
    with pytest.raises(ValueError, match="repeats a uid"):
        baseline_column(samples, ["0:0", "0:0", "0:1"], [1.0, 1.0, 0.0])


def _tensor(owner: str, rows: int) -> TensorHandle:
    return TensorHandle(owner, "k", (rows, 2), "torch.int64", "cpu", rows * 16)


def test_baseline_handle_follows_the_rollout_row_shards() -> None:
    # a rollout split over two actor ranks (n=2): rank 0 holds prompt 0's samples, rank 1 prompt 1's
    rollout = BatchHandle((
        Shard("actor:0", 2, {"responses": _tensor("actor:0", 2)}, {"uid": ["5:0", "5:0"]}),
        Shard("actor:1", 2, {"responses": _tensor("actor:1", 2)}, {"uid": ["5:1", "5:1"]}),
    ))
    greedy = BatchHandle((
        Shard("actor:0", 1, {}, {"uid": ["5:0"]}), Shard("actor:1", 1, {}, {"uid": ["5:1"]}),
    ))
    scores = BatchHandle((Shard("reward:0", 1, {}, {"score": [0.1]}), Shard("reward:1", 1, {}, {"score": [1.0]})))
    handle = baseline_handle(rollout, greedy, scores)
    assert len(handle) == len(rollout) == 4 and handle.nbytes == 0
    assert non_tensor(handle, BASELINE) == [0.1, 0.1, 1.0, 1.0]
    # what rank 1 would receive for its rows under a split: its own prompt's baseline
    assert non_tensor(handle.slice(2, 4), BASELINE) == [1.0, 1.0]


def test_keyed_prompts_gives_each_prompt_a_step_uid() -> None:
    prompts = prompts_handle({"prompt": ["1+1=", "2+0="], "ground_truth": ["2", "2"], "uid": ["a", "a"]})
    keyed = keyed_prompts(prompts, 7)
    assert non_tensor(keyed, "uid") == ["7:0", "7:1"]
    assert non_tensor(keyed, "prompt") == ["1+1=", "2+0="] and non_tensor(keyed, "ground_truth") == ["2", "2"]
    with_tensor = BatchHandle((Shard("actor:0", 2, {"input_ids": _tensor("actor:0", 2)}, {"prompt": ["x", "y"]}),))
    with pytest.raises(ValueError, match="tensor columns"):
        keyed_prompts(with_tensor, 0)
