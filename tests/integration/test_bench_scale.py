"""`hfrt bench scale` at small rank counts (8 and 32 simulated ranks, plus the 2-rank baseline),
as CI runs it: every figure docs/bench-and-performance.md (Scale) names is measured, the start-up
sends no directory, the killed daemon is found within two heartbeats and replaced, and nothing
healthy is declared dead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KEYS = ("ranks", "ready_s", "broadcast_p50_ms", "broadcast_p99_ms", "dispatch_p50_ms", "step_overhead_ms",
        "controller_rss_mb", "detect_dead_s", "replace_s", "peer_directory_bytes", "heartbeat_s",
        "controller_cpu_ms_per_broadcast", "controller_cpu_ms_per_dispatch", "controller_cpu_s_per_step")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_scale_at_8_and_32_ranks(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [sys.executable, "-m", "hfrt", "bench", "scale", "--ranks", "8,32", "--heartbeat", "1.0", "--broadcasts", "10",
         "--dispatches", "10", "--steps", "3", "--log-dir", str(tmp_path / "logs"), "--json", "--out", str(out)],
        capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["ranks"] for r in result["rows"]] == [2, 8, 32]
    for row in result["rows"]:
        assert all(key in row for key in KEYS), sorted(set(KEYS) - set(row))
        assert row["peer_directory_bytes"] == 0, "a start-up sends no directory"
        assert row["false_deaths"] == 0
        assert 0 < row["detect_dead_s"] <= 2 * row["heartbeat_s"] + 0.5  # slack for a loaded CI machine's wake-ups
        assert row["replace_s"] > 0 and row["controller_cpu_ms_per_broadcast"] > 0
        assert row["step_ranks"] == max(4, row["ranks"])
    assert result["rows"][-1]["peer_directory_bytes_run"] > 0, "the step's calls told daemons the owners they read"
    assert "cpu_ms_per_broadcast_us_per_rank" in result and "predicted_16384_cpu_ms_per_broadcast" in result
    assert "ranks" in done.stdout and "bcast p50 ms" in done.stdout
