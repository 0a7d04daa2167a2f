"""The one-call GPU check on the CPU: bench/gpu/check.sh itself runs the model-building and
hybrid-transition parts on a tiny Qwen3 and writes its JSON; the driver records a part that fails
or overruns its time box and goes on; the budget, once spent, skips what is left; the configs are
the published sizes. (The GPU parts need a GPU; the whole --cpu run takes minutes: see
docs/bench-and-performance.md, "The one-call GPU check".)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfrt.bench import gpu_check
from hfrt.bench.gpu_check import Part, check, gpu_test_files, last_json, pytest_counts, run_part
from hfrt.bench.gpu_models import CONFIGS, parameter_count

ROOT = Path(__file__).resolve().parents[2]


def test_check_sh_builds_a_tiny_qwen3_and_times_its_transition(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, CHECK_BUDGET_S="100")
    proc = subprocess.run([str(ROOT / "bench" / "gpu" / "check.sh"), "--cpu", "--parts", "models,transition", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.loads(Path(summary["path"]).read_text())
    assert report["mode"] == "cpu" and report["failed"] == [], report
    assert set(report["parts"]) == {"models", "transition"}
    built = report["parts"]["models"]["result"]["models"][0]
    assert built["model"] == "qwen3-tiny" and built["parameters"] == parameter_count("qwen3-tiny")
    moved = report["parts"]["transition"]["result"]
    assert moved["model"] == "qwen3-tiny" and moved["to_generate_s"] > 0 and moved["generate_s"] > 0


def test_a_failing_or_overrunning_part_is_recorded_and_the_rest_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    py = [sys.executable, "-c"]
    steps = [
        Part("fails", 10, [], [*py, "import sys; print('boom'); sys.exit(3)"]),
        Part("overruns", 1, [], [*py, "import time; time.sleep(30)"]),
        Part("works", 10, [], [*py, "print('noise'); print('{\"x\": 1}')"]),
    ]
    monkeypatch.setattr(gpu_check, "parts", lambda workdir: steps)
    out = check(cpu=True, budget_s=30, only=None, workdir=str(tmp_path))
    assert out["fails"]["status"] == "failed" and out["fails"]["returncode"] == 3 and "boom" in out["fails"]["output_tail"]
    assert out["overruns"]["status"] == "timeout" and out["overruns"]["seconds"] < 10
    assert out["works"] == out["works"] | {"status": "ok", "result": {"x": 1}}


def test_a_spent_budget_skips_the_parts_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = Part("slow", 60, [], [sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setattr(gpu_check, "parts", lambda workdir: [slow, Part("next", 10, [], [sys.executable, "-c", "pass"])])
    out = check(cpu=True, budget_s=6, only=None, workdir=str(tmp_path))
    assert out["slow"]["status"] == "timeout" and out["next"]["status"] == "skipped"
    assert run_part(Part("x", 5, [], []), [sys.executable, "-c", "print(1)"], 5, dict(os.environ))["result"] is None


def test_outputs_are_read_and_gpu_tests_found() -> None:
    assert last_json('log\n{"a": 1}\n{"b": 2}\ntrailing') == {"b": 2}
    assert pytest_counts("4 passed, 2 skipped, 1 failed in 3.2s") == {"passed": 4, "skipped": 2, "failed": 1}
    files = {Path(f).name for f in gpu_test_files()}
    assert {"test_gpu.py", "test_gpu_plane.py"} <= files


def test_the_configs_are_the_published_sizes() -> None:
    assert round(parameter_count("qwen3-0.6b") / 1e6) == 596  # Qwen3-0.6B: 0.6B with its tied embedding
    assert round(parameter_count("qwen3-1.7b") / 1e6) == 1721
    assert CONFIGS["qwen3-1.7b"]["num_hidden_layers"] == 28 and CONFIGS["qwen3-1.7b"]["hidden_size"] == 2048


def test_the_docs_name_every_part_with_its_time_box_and_the_cpu_run() -> None:
    page = (ROOT / "docs" / "bench-and-performance.md").read_text()
    steps = gpu_check.parts("/w")
    for part in steps:
        assert f"| {part.name} | {part.box_s:.0f} s |" in page, f"docs/bench-and-performance.md lacks the row of {part.name}"
    assert sum(p.box_s for p in steps) + 60 + 10 <= 540, "install + parts + slack must fit in 9 minutes"
    rehearsal = json.loads((ROOT / "bench" / "results" / "gpu-check-cpu-2026-11-27.json").read_text())
    assert rehearsal["mode"] == "cpu" and rehearsal["failed"] == [] and len(rehearsal["parts"]) == len(steps)
    text = " ".join(page.split())
    assert f"all six parts passed in {rehearsal['total_s']:.0f} s" in text
