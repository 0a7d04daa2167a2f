"""`hfrt bench vs-trl`'s side figures: padding fractions before token budgets (every row padded to
the batch's longest prompt and response) and as the engine plans micro-batches now, and the
peak RSS of processes below the bench (a real child process)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hfrt.bench.vs_trl_measure import DaemonRSS, padding_fractions


def test_padding_before_and_after_token_budgets() -> None:
    prompt, response = [2, 2, 2, 2], [1, 5, 1, 5]
    rows = padding_fractions(prompt, response, {"micro_batch_size": 4})
    assert rows["padding_before"] == pytest.approx(1 - 20 / 28, abs=1e-4)
    assert rows["padding_after"] == rows["padding_before"]  # one micro-batch of every row: the same slots
    packed = padding_fractions(prompt, response, {"micro_batch_size": 4, "max_tokens_per_micro_batch": 16, "pack": True})
    assert packed["padding_after"] == 0.0
    trimmed = padding_fractions(prompt, response, {"micro_batch_size": 4, "max_tokens_per_micro_batch": 14})
    assert 0.0 <= trimmed["padding_after"] < rows["padding_before"]  # long rows together, short rows together


def test_peak_rss_of_child_processes() -> None:
    code = "import sys, time; x = b'1' * (80 * 2**20); print('ready', flush=True); time.sleep(1.0)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"  # 80 MiB touched
    rss = DaemonRSS(interval_s=0.05)
    rss.start()
    try:
        time.sleep(0.5)
    finally:
        figures = rss.stop()
        child.wait()
    assert figures["hfrt_peak_daemon_rss_mb"] >= 80.0
    assert figures["hfrt_peak_daemons_rss_total_mb"] >= figures["hfrt_peak_daemon_rss_mb"]
