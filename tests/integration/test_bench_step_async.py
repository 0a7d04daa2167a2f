"""`hfrt bench step --flows grpo,grpo_async --split --rounds 2` as a user runs it: the flows
alternate on fresh daemons, every round's step times, ratio and load average are reported, and the
async flow's staleness and sync figures come with it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_bench_step_interleaves_grpo_and_grpo_async() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "bench", "step", "--flows", "grpo,grpo_async", "--split", "--rounds", "2",
         "--steps", "1", "--warmup", "0", "--heartbeat-s", "5", "--json"],
        capture_output=True, text=True, timeout=410,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [sorted(r) for r in result["rounds"]] == [["grpo_async_over_grpo", "grpo_async_step_s", "grpo_step_s", "load_avg"]] * 2
    assert result["flows"]["grpo"]["steps"] == result["flows"]["grpo_async"]["steps"] == 2  # 1 measured step x 2 rounds
    assert result["grpo_async_over_grpo_round_median"] > 0 and result["split_gen_roles"] == ["rollout"]
    figures = result["flows"]["grpo_async"]["async"]
    assert figures["async/staleness_max"] <= 1 and figures["sync/bytes"] > 0 and figures["async/dropped_rows"] == 0
    assert result["flows"]["grpo_async"]["controller_bulk_bytes"] == 0
