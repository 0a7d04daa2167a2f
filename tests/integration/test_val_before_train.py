"""Validation before the first step (val_before_train, on by default when val_every is set) and
the first / last validation accuracy in the run summary, on real local daemons."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def controller(run_dir: Path, *sets: str) -> dict:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(run_dir)]
    for item in ("steps=2", "prompts_per_step=4", "n=2", "export_hf=false", "val_prompts=4", *sets):
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_validation_before_training_and_accuracy_in_the_summary(tmp_path: Path) -> None:
    summary = controller(tmp_path / "a", "val_every=2")
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert "val_before/accuracy" in records[0] and "val_before/reward_mean" in records[0]
    assert "val_before/accuracy" not in records[1] and "val/accuracy" in records[1]
    assert summary["val_accuracy_first"] == records[0]["val_before/accuracy"]
    assert summary["val_accuracy_last"] == records[1]["val/accuracy"]
    off = controller(tmp_path / "b", "val_every=2", "val_before_train=false")
    first = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert "val_before/accuracy" not in first and off["val_accuracy_first"] == off["val_accuracy_last"]
