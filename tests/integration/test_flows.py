"""The built-in RL flows as a user runs them: `hfrt controller --flow ppo|grpo` on real local
daemons (the embedded default roles, the `tiny` preset, the addition task), metrics.jsonl per
step, stage 2 overlapping, no tensor bytes through the controller. Plus the flow config checks
and the no-torch rule for the controller side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfrt.flows.grpo_family import GRPOConfig
from hfrt.flows.ppo_family import PPOConfig

REQUIRED = ("step", "reward/mean", "kl/mean", "timing/step_s", "timing/generate_s", "timing/stage2_s",
            "timing/old_log_prob_s", "timing/advantages_s", "timing/update_s", "controller_bulk_bytes",
            "advantages/mean", "returns/mean", "actor/pg_loss")
STAGE2 = {"ppo": ("values", "ref_log_prob", "reward"), "grpo": ("ref_log_prob", "reward")}


def run_flow(name: str, run_dir: Path, *sets: str) -> dict:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", name, "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_flow_runs_two_steps_on_real_daemons(name: str, tmp_path: Path) -> None:
    summary = run_flow(name, tmp_path / "run", "steps=2")
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        # GRPO's update is on-policy by default (one optimizer step): no old-log-prob pass
        required = [k for k in REQUIRED if name == "ppo" or k != "timing/old_log_prob_s"]
        missing = [k for k in required + [f"timing/{s}_s" for s in STAGE2[name]] if k not in record]
        assert not missing, missing
        assert ("timing/old_log_prob_s" in record) == (name == "ppo")
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["controller_bulk_bytes"] == 0
        # stage 2's calls ran at the same time: its wall time is under the sum of theirs
        assert record["timing/stage2_s"] < sum(record[f"timing/{s}_s"] for s in STAGE2[name])
    if name == "ppo":
        assert "critic/loss" in records[0] and "actor/reward_kl_penalty_coeff" in records[0]
        assert records[0]["timing/update_s"] < records[0]["timing/critic_update_s"] + records[0]["timing/actor_update_s"]
    assert summary["reward_first"] == records[0]["reward/mean"]


def test_flows_import_no_torch() -> None:
    code = "import sys, hfrt.flows.recipes.ppo, hfrt.flows.recipes.grpo; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_flow_config_checks_keys_and_types() -> None:
    cfg = PPOConfig.read({"steps": 3, "gamma": 1, "run_dir": "/tmp/x"})
    assert cfg.steps == 3 and cfg.gamma == 1.0 and isinstance(cfg.gamma, float)
    assert GRPOConfig.read({"norm_adv_by_std": False}).norm_adv_by_std is False
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['stepz'\]"):
        PPOConfig.read({"stepz": 3})
    with pytest.raises(ValueError, match="config steps='many': expected int"):
        GRPOConfig.read({"steps": "many"})
    with pytest.raises(ValueError, match="expected int"):
        GRPOConfig.read({"n": True})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ppo_on_a_jsonl_file_with_validation(tmp_path: Path) -> None:
    """Prompts from a data file (5 rows, 4 a step: the second step wraps into epoch 1), a greedy
    validation pass on a second file every step, and the data position in the checkpoint."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{a}+1=", "ground_truth": str(a + 1)}) + "\n" for a in range(5)))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{a}+0=", "reward_model": {"ground_truth": str(a)}}) + "\n" for a in range(3)))
    run_dir = tmp_path / "run"
    summary = run_flow("ppo", run_dir, "steps=2", "prompts_per_step=4", f"data={train}", f"val_data={val}",
                       "val_every=1", "checkpoint_every=2", "export_hf=false")
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert 0.0 <= record["val/reward_mean"] <= 1.0 and 0.0 <= record["val/accuracy"] <= 1.0
    state = json.loads((run_dir / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert state["data"] == {"path": str(train), "rows": 5, "epoch": 1, "position": 3}
