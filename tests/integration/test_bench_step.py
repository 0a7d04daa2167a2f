"""`hfrt bench step` as a user runs it: real daemons for both built-in flows, the --json contract
(one object on the last stdout line), stage-2 overlap figures, and no tensor bytes through the
controller."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_bench_step_json_contract_and_overlap() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "bench", "step", "--steps", "1", "--warmup", "0", "--json"],
        capture_output=True, text=True, timeout=230,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("stage2_wall_s", "stage2_max_s", "stage2_sum_s", "controller_bulk_bytes", "tokens_per_s"):
        assert key in result, key
    # the three PPO stage-2 calls run together: the stage takes less than their times added up
    assert result["stage2_wall_s"] < result["stage2_sum_s"]
    assert result["stage2_max_s"] <= result["stage2_wall_s"] + 1e-3
    assert result["controller_bulk_bytes"] == 0
    assert result["tokens_per_s"] > 0
    assert set(result["flows"]) == {"ppo", "grpo"}
    assert result["flows"]["ppo"]["stage2_calls"] == ["values", "ref_log_prob", "reward"]
    assert result["flows"]["grpo"]["stage2_calls"] == ["ref_log_prob", "reward"]
    assert result["flows"]["grpo"]["controller_bulk_bytes"] == 0


def test_bench_step_rejects_an_unknown_flow() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "bench", "step", "--flows", "ppo,nope"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "nope" in out.stderr
