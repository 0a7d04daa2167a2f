"""The pipeline recipe of docs/pipeline.md, whole and short (`--quick`: a few steps a stage), on the
tiny preset: SFT → RM → PPO and SFT → DPO, one command each, every stage a built-in flow on real
daemons printing its figure, each stage starting from the one before (the reward model's backbone,
PPO's actor, critic and reference, DPO's policy and reference are the SFT export; PPO's reward
role serves the reward model). The committed full runs are the page's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def recipe(chain: str, work: Path) -> tuple[dict[str, Any], str]:
    done = subprocess.run([sys.executable, "-m", "hfrt.bench.recipes.rlhf_pipeline", chain, "--quick", "--work", str(work)],
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout), done.stderr


def roles(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / "config.json").read_text())["roles"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_then_rm_then_ppo(tmp_path: Path) -> None:
    result, printed = recipe("rlhf", tmp_path)
    stages = result["stages"]
    assert list(stages) == ["sft", "rm", "ppo"] and [line.split("]")[0] + "]" for line in printed.splitlines()
                                                     if line.startswith("[")] == ["[sft]", "[rm]", "[ppo]"]
    sft = stages["sft"]["model"]
    assert 0.0 < stages["sft"]["val_token_accuracy"] <= 1.0 and 0.0 <= stages["sft"]["rule_accuracy"] <= 1.0
    assert 0.5 < stages["rm"]["val_accuracy"] <= 1.0 and 0.0 <= stages["ppo"]["rule_accuracy"] <= 1.0
    run = tmp_path / "rlhf"
    assert roles(run / "rm")["reward_model"]["options"]["model"] == sft
    ppo = roles(run / "ppo")
    assert all(ppo[name]["options"]["model"] == sft for name in ("actor", "critic", "reference"))
    assert ppo["reward"]["options"]["model"] == stages["rm"]["model"] and ppo["reward"]["options"]["kind"] == "model"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_then_dpo(tmp_path: Path) -> None:
    result, _ = recipe("dpo", tmp_path)
    stages = result["stages"]
    assert list(stages) == ["sft", "dpo"] and 0.5 < stages["dpo"]["val_rewards_accuracies"] <= 1.0
    dpo = roles(tmp_path / "dpo" / "dpo")
    assert dpo["actor"]["options"]["model"] == dpo["reference"]["options"]["model"] == stages["sft"]["model"]


def test_the_committed_figures_are_the_pages() -> None:
    """docs/pipeline.md's table is the two committed runs of the recipe."""
    results = ROOT / "bench" / "results"
    rlhf = json.loads((results / "rlhf-pipeline-2026-11-27.json").read_text())["stages"]
    dpo = json.loads((results / "sft-dpo-pipeline-2026-11-27.json").read_text())["stages"]
    assert round(rlhf["sft"]["rule_accuracy"] * 9) == round(dpo["sft"]["rule_accuracy"] * 9) == 4
    assert rlhf["rm"]["val_accuracy"] == 1.0 and round(rlhf["ppo"]["rule_accuracy"] * 9) == 7
    assert dpo["dpo"]["val_rewards_accuracies"] == 0.995 and round(dpo["dpo"]["rule_accuracy"] * 9) == 8
    page = (ROOT / "docs" / "pipeline.md").read_text()
    for shown in ("greedy rule accuracy **4/9**", "held-out pair accuracy **1.00**", "greedy rule accuracy **7/9**",
                  "held-out reward accuracy **0.995**; greedy rule accuracy **8/9**"):
        assert shown in page, shown
