"""`hfrt bench vs-trl-sft` (docs/bench-and-performance.md): hfrt's sft_update on a real
actor daemon and TRL's SFTTrainer, interleaved on the tiny preset, start from the same loss on
the same rows; and the page's figures are the committed runs'. Skipped, saying so, without trl."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (the bench extra; .ci/install installs it)")
def test_both_sides_step_from_the_same_loss() -> None:
    done = subprocess.run([sys.executable, "-m", "hfrt", "bench", "vs-trl-sft", "--steps", "2", "--warmup", "0", "--json"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["first_loss_hfrt"] == pytest.approx(result["first_loss_trl"], abs=1e-5)
    assert result["hfrt_step_s"] > 0 and result["trl_step_s"] > 0 and len(result["hfrt_steps_s"]) == 2


def test_the_pages_figures_are_the_committed_runs() -> None:
    smollm2 = json.loads((ROOT / "bench" / "results" / "vs-trl-sft-2026-11-27-smollm2.json").read_text())
    tiny = json.loads((ROOT / "bench" / "results" / "vs-trl-sft-2026-11-27-tiny.json").read_text())
    assert (round(smollm2["hfrt_step_s"], 1), round(smollm2["trl_step_s"], 1), round(smollm2["speedup"], 2)) == (28.5, 49.5, 1.73)
    assert smollm2["first_loss_hfrt"] == smollm2["first_loss_trl"] == 5.546388
    assert (round(tiny["hfrt_step_s"], 2), round(tiny["trl_step_s"], 2), round(tiny["speedup"], 2)) == (0.19, 0.13, 0.7)
    page = (ROOT / "docs" / "bench-and-performance.md").read_text()
    assert "**28.5 s against 49.5 s a step (1.73×)**, first loss 5.546388" in page and "0.19 s against 0.13 s (0.70×)" in page
