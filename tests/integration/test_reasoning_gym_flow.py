"""A reasoning-gym task trained as a user names it: `hfrt controller --flow grpo --set
data=reasoning_gym:basic_arithmetic` on real local daemons (tiny preset, two steps), the rows'
entries scored on the reward daemon by the task's own scorer (the `reasoning_gym` reward with no
sample allowed to fail), a greedy validation pass on held-out seeds, and the data position saved
in the checkpoint. The docs section it backs: docs/configuration.md, "reasoning-gym tasks"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install -e '.[envs]')")


def run(run_dir: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=230)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_trains_on_a_reasoning_gym_task(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run(run_dir, "data=reasoning_gym:basic_arithmetic", "data_options.size=40", "data_options.max_terms=2",
              "data_options.system_prompt=direct", "steps=2", "prompts_per_step=4", "n=2", "max_new_tokens=8",
              "val_every=2", "val_prompts=4", "checkpoint_every=2", "export_hf=false",
              "roles.reward.options.function=reasoning_gym", "roles.reward.options.error_score=null")
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert 0.0 <= record["reward/mean"] <= 1.0
    assert 0.0 <= records[-1]["val/accuracy"] <= 1.0 and "val_before/accuracy" in records[0]
    state = json.loads((run_dir / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert state["data"] == {"task": "basic_arithmetic", "size": 40, "epoch": 0, "position": 8}


def test_a_misspelled_task_exits_2_before_any_daemon(tmp_path: Path) -> None:
    out = run(tmp_path / "run", "data=reasoning_gym:basic_arithmetc", "steps=1")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "did you mean basic_arithmetic" in out.stderr
