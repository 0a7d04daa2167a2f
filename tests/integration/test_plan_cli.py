"""`hfrt plan` as a real subprocess: the table, --json, --out (a spec `hfrt launch` and
`--cluster` accept: loaded with the spec reader, and run for real with the tiny preset), --calibrate
on a run folder, and clear errors for a bad PLAN.toml."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfrt.deploy import load_spec

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TINY_PLAN = ROOT / "deploy" / "examples" / "plan-ppo-tiny-cpu.toml"
BIG_PLAN = ROOT / "deploy" / "examples" / "plan-ppo-13b-70b.toml"


def hfrt(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_json_line_has_the_best_mapping_and_search_figures() -> None:
    out = hfrt("plan", str(BIG_PLAN), "--json", "--top", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert {"best", "predicted_step_s", "candidates_evaluated", "plan_s", "top", "efficiency"} <= set(data)
    assert data["devices"] == 128 and len(data["top"]) == 3 and data["candidates_evaluated"] > 100
    assert data["predicted_step_s"] == data["best"]["step_s"] > 0
    best_sets = data["best"]["sets"]
    assert sum(s["devices"] for s in best_sets) == 128
    assert sorted(r for s in best_sets for r in s["roles"]) == ["actor", "critic", "reference", "reward"]
    actor = next(s["roles"]["actor"] for s in best_sets if "actor" in s["roles"])
    assert {"pp", "tp", "dp", "generate"} <= set(actor)
    assert set(data["best"]["stage_s"]) == {"generate", "stage2", "old_log_prob", "update"}


def test_table_and_spec_for_two_cpu_devices(tmp_path: Path) -> None:
    out_spec = tmp_path / "cluster.toml"
    out = hfrt("plan", str(TINY_PLAN), "--out", str(out_spec))
    assert out.returncode == 0, out.stderr
    assert "placement (devices)" in out.stdout and "actor+critic+reference (2)" in out.stdout
    assert f"hfrt controller --cluster {out_spec} --flow ppo" in out.stdout
    spec = load_spec(out_spec)
    spec.check_roles(["actor", "critic", "reference", "reward"], "flow 'ppo'")
    assert spec.launcher == "local" and [n.name for n in spec.nodes] == ["localhost"]
    assert sum(len(p.slots) for p in spec.pools.values()) == 2


@pytest.mark.slow
def test_calibrate_fits_factors_from_a_run_folder(tmp_path: Path) -> None:
    """A run folder as `hfrt controller` leaves it: config.json and metrics.jsonl with timings."""
    run = tmp_path / "run"
    run.mkdir()
    roles = {"actor": {"impl": "actor", "options": {"model": "tiny"}}, "critic": {"impl": "critic", "options": {"model": "tiny"}},
             "reference": {"impl": "reference", "options": {"model": "tiny"}},
             "reward": {"impl": "reward", "options": {"kind": "function", "function": "hfrt.flows.tasks:addition_reward"}}}
    (run / "config.json").write_text(json.dumps({"flow": {"steps": 6}, "roles": roles}))
    rows = [{"step": i, "timing/generate_s": 0.012, "timing/stage2_s": 0.010, "timing/old_log_prob_s": 0.005,
             "timing/advantages_s": 0.008, "timing/update_s": 0.055, "timing/step_s": 0.095} for i in range(6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = hfrt("plan", str(TINY_PLAN), "--calibrate", str(run), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    stages = data["calibration"]["stages"]
    assert set(stages) == {"generate", "stage2", "old_log_prob", "update"} and data["calibration"]["steps"] == 4
    for s in stages.values():  # the fit lands closer to what was measured than the defaults did
        assert abs(s["predicted_after_s"] - s["measured_s"]) <= abs(s["predicted_before_s"] - s["measured_s"]) + 1e-9
    assert data["efficiency"] != {"forward": 0.5, "train": 0.4, "decode": 0.6, "comm": 0.7, "latency": 1.0, "call_s": 0.02}
    text = hfrt("plan", str(TINY_PLAN), "--calibrate", str(run))
    assert "[efficiency]" in text.stdout and "update:" in text.stdout


def test_the_planner_imports_no_torch() -> None:
    """It runs on a controller machine: planning a flow (its module imported) loads no torch."""
    code = ("import sys; from hfrt.deploy.plan.cli import main; from hfrt.deploy.plan.calibrate import calibrate; "
            "from hfrt.deploy.plan.file import load_plan; from hfrt.deploy.plan.search import search; "
            f"search(load_plan({str(TINY_PLAN)!r}).problem); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(("plan", "message"), [
    ('flow = "ppo"\n[cluster]\nhardware = "TPU"\n', "hardware = 'TPU' is not one of H100, H200, A100, cpu"),
    ('flow = "ppo"\n[models]\njudge = "tiny"\n', "[models]: unknown role 'judge'"),
    ('flow = "nope"\n', "flow 'nope': not a built-in flow"),
    ('flow = "ppo"\n[workload]\nresponse_len = 0\n', "response_len must be >= 1"),
    ('flow = "ppo"\n[cluster]\nhardware = "cpu"\nmemory_gb = 0.001\n[models]\nactor = "llama-70b"\n', "no mapping fits"),
    ('flow = "ppo"\nnot toml', "not valid TOML"),
])
def test_bad_plan_is_a_clear_error(plan: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(plan)
    out = hfrt("plan", str(path))
    assert out.returncode in (1, 2) and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_calibrate_on_a_folder_without_a_run_is_a_clear_error(tmp_path: Path) -> None:
    out = hfrt("plan", str(TINY_PLAN), "--calibrate", str(tmp_path))
    assert out.returncode == 2 and "cannot read config.json and metrics.jsonl" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_planned_spec_runs_the_ppo_flow_for_real(tmp_path: Path) -> None:
    """The best mapping for 2 CPU devices, launched by `hfrt controller --cluster` unchanged."""
    spec = tmp_path / "cluster.toml"
    assert hfrt("plan", str(TINY_PLAN), "--out", str(spec)).returncode == 0
    run = tmp_path / "run"
    out = hfrt("controller", "--cluster", str(spec), "--flow", "ppo", "--set", "steps=2", "--set", "progress=off",
               "--set", "export_hf=false", "--set", "tensorboard=false", "--run-dir", str(run), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("timing/update_s" in r for r in rows)
