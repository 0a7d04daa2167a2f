"""Routing replay as a user runs it: `hfrt controller` GRPO on the tiny-moe preset with
`roles.actor.options.router_replay` on (the trainer's routing equals the rollout's on every step:
router_mismatch/share 0, the log-prob gap at rounding level) and off on a stale rollout
(grpo_async, max_staleness=1: after the first update the trainer routes differently from the
rollout's weights, and the metric shows it). The routing column stays on the daemons (0 bytes
through the controller)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SMALL = ("steps=3", "prompts_per_step=4", "n=4", "tensorboard=false", "trace=false", "export_hf=false")


def run(flow: str, run_dir: Path, *sets: str) -> list[dict[str, Any]]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", flow, "--run-dir", str(run_dir)]
    for item in (*SMALL, *sets):
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout[out.stdout.index("{"):])["controller_bulk_bytes"] == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_replay_has_no_routing_mismatch(tmp_path: Path) -> None:
    records = run("grpo", tmp_path / "on", "roles.actor.options.model=tiny-moe",
                  "roles.reference.options.model=tiny-moe", "roles.actor.options.router_replay=true")
    assert len(records) == 3
    for r in records:
        assert r["router_mismatch/replay"] == 1.0 and r["router_mismatch/routings"] > 0
        assert r["router_mismatch/share"] == 0.0 and r["router_mismatch/own_share"] == 0.0  # same weights, same kernels
        assert r["router_mismatch/log_prob_abs_diff"] < 1e-5  # fp32, HF engine and trainer: same kernels


def test_stale_rollout_without_replay_shows_the_mismatch(tmp_path: Path) -> None:
    models = [f"roles.{role}.options.model=tiny-moe" for role in ("actor", "reference", "rollout")]
    records = run("grpo_async", tmp_path / "off", "steps=4", "max_staleness=1", *models,
                  "roles.actor.options.router_replay=false", "roles.rollout.options.router_replay=false")
    assert records[0]["async/staleness_max"] == 0.0 and all(r["async/staleness_max"] <= 1.0 for r in records)
    for r in records:
        assert r["router_mismatch/replay"] == 0.0 and r["router_mismatch/routings"] > 0
        assert r["router_mismatch/share"] == r["router_mismatch/own_share"]  # off: the experts used are its own
    fresh = [r for r in records if r["async/staleness_max"] == 0.0]
    stale = [r for r in records if r["async/staleness_max"] == 1.0]
    assert stale, "no step trained on a rollout one update old"
    # the rollout's own weights: (nearly) the same routing; one update old: part of the tokens go elsewhere
    assert all(r["router_mismatch/share"] < 0.01 for r in fresh)
    assert max(r["router_mismatch/share"] for r in stale) > 0.02, [r["router_mismatch/share"] for r in stale]
    assert all(r["router_mismatch/log_prob_abs_diff"] > 1e-4 for r in stale)
