"""`hfrt bench limit`: the floor's and the step's medians and their ratio, a real run on the tiny
preset (hfrt's daemons interleaved with the floor process: both step, the JSON has the figures the
docs name), and the figures docs/bench-and-performance.md states are the committed SmolLM2 run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfrt.bench.limit import TARGET, summarize

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "limit-2026-11-27-smollm2-run2.json"


def test_floor_is_the_sum_of_its_stages_and_the_ratio_is_step_over_floor() -> None:
    ours = [{"wall_s": w, "response_tokens": 30.0, "timing/generate_s": 1.0, "timing/ref_log_prob_s": 0.5, "timing/update_s": 2.0}
            for w in (9.0, 4.4, 4.0, 4.2)]
    floor = [{"generate_s": g, "reference_s": 0.5, "update_s": 2.0, "tokens": 31} for g in (5.0, 1.0, 1.5, 0.5)]
    out = summarize({"hfrt": ours, "floor": floor, "floor_ready_s": 3.0}, warmup=1)
    assert out["step_s"] == 4.2 and out["floor_s"] == 3.5  # medians over the measured steps: 4.0, 4.2, 4.4 / 3.0, 3.5, 4.0
    assert out["overhead_ratio"] == round(4.2 / 3.5, 4) and out["overhead_s"] == 0.7
    assert out["target_met"] is (out["overhead_ratio"] <= TARGET)
    assert out["stage_over_floor"] == {"generate_s": 1.0, "reference_s": 1.0, "update_s": 1.0}


@pytest.mark.slow
def test_a_real_run_on_the_tiny_preset(tmp_path: Path) -> None:
    out = tmp_path / "limit.json"
    proc = subprocess.run([sys.executable, "-m", "hfrt.cli", "bench", "limit", "--model", "tiny", "--engine", "hf", "--steps", "1",
                           "--warmup", "0", "--prompts", "2", "--json", "--out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step_s"] > 0 and result["floor_s"] > 0 and result["floor_tokens"] > 0 and result["hfrt_tokens"] > 0
    assert result["overhead_ratio"] == round(result["step_s"] / result["floor_s"], 4)
    assert set(result["floor_stages_s"]) == {"generate_s", "reference_s", "update_s"}
    assert {"generate_s", "ref_log_prob_s", "update_s"} <= set(result["hfrt_stages_s"])


def test_the_docs_figures_are_the_committed_run() -> None:
    result = json.loads(RESULT.read_text())
    assert result["model"] == "smollm2-135m" and result["engine"] == "vllm"
    text = " ".join((ROOT / "docs" / "bench-and-performance.md").read_text().split())
    f, s, st = result["floor_stages_s"], result["hfrt_stages_s"], "bench/results/limit-2026-11-27-smollm2-run2.json"
    assert st in text
    for figure in (f"{result['step_s']:.2f} s", f"{result['floor_s']:.2f} s", f"{result['overhead_ratio']:.2f}×",
                   f"{f['generate_s']:.2f}", f"{f['reference_s']:.2f}", f"{f['update_s']:.2f}",
                   f"{s['generate_s']:.2f}", f"{s['ref_log_prob_s']:.2f}", f"{s['update_s']:.2f}"):
        assert figure in text, f"docs/bench-and-performance.md lacks {figure} from {st}"
    if "overhead_ratio_cpu" in result:  # CPU seconds, the figure other jobs move less
        for figure in (f"**{result['step_cpu_s']:.1f}**", f"**{result['floor_cpu_s']:.1f}**", f"({result['overhead_ratio_cpu']:.2f}×)"):
            assert figure in text, f"docs/bench-and-performance.md lacks {figure} from {st}"
