"""A run killed with kill -9 mid-run resumes from its last checkpoint (`hfrt controller --resume`):
no step before the checkpoint is lost or repeated, weights and optimizer state come back (the
engines' step counters continue), the orphaned daemons exit on their own, and the finished run
exports the actor as a Hugging Face folder that transformers loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support import STARTED_PIDS

STEPS = 30  # long enough that the kill lands mid-run even on a fast machine (~0.25 s a step)


def read_metrics(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().removeprefix("step_")) if pointer.exists() else 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill_9_mid_run_then_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--run-dir", str(run_dir),
         "--set", f"steps={STEPS}", "--set", "checkpoint_every=2", "--set", "export_hf=false",
         "--heartbeat", "1.0", "--orphan-timeout", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    daemons: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while latest_step(run_dir) < 4 and first.poll() is None and time.monotonic() < deadline:
            daemons = psutil.Process(first.pid).children(recursive=True) or daemons
            STARTED_PIDS.update(d.pid for d in daemons)
            time.sleep(0.05)
        assert first.poll() is None, f"the run ended before it was killed: {first.communicate()[1][-3000:]}"
        assert latest_step(run_dir) >= 4, "no checkpoint at step 4 within 240 s"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    # the daemons lost their controller: they exit by themselves
    gone, alive = psutil.wait_procs(daemons, timeout=30)
    assert daemons and not alive, f"daemons still running 30 s after their controller died: {alive}"

    ckpt_step = latest_step(run_dir)
    assert ckpt_step < STEPS
    before = [line for line in read_metrics(run_dir) if _step_of(line) is not None and _step_of(line) < ckpt_step]  # type: ignore[operator]
    assert [_step_of(line) for line in before] == list(range(ckpt_step))

    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--resume", str(run_dir), "--set", "export_hf=true"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["resumed_from_step"] == ckpt_step and summary["steps"] == STEPS

    after = read_metrics(run_dir)
    assert [_step_of(line) for line in after] == list(range(STEPS)), "a step was lost or repeated"
    assert after[:ckpt_step] == before, "records before the checkpoint changed"

    # weights + optimizer state came back: one optimizer step per RL step, counted across the kill
    final = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    for role in ("actor", "critic"):
        engine = json.loads((final / role / "hfrt_engine.json").read_text())
        assert engine["steps"] == STEPS, (role, engine["steps"])
    state = json.loads((final / "state.json").read_text())
    assert state["step"] == STEPS and state["advantage"]["kind"] == "fixed"

    _check_hf_export(Path(summary["hf_export"]))


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError):
        return None


def _check_hf_export(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfrt.roles.models import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_dir("tiny"))
    trained, initial = dict(model.named_parameters()), dict(base.named_parameters())
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained), "the export holds the untrained weights"
    ids = tok("1+1=", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 2 or int(out[0, -1]) == tok.eos_token_id


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_passes_over_a_damaged_latest_checkpoint(tmp_path: Path) -> None:
    """A truncated state.json in the newest checkpoint: the resume says so before any daemon
    starts, then continues from the previous whole checkpoint (no step lost or repeated); the
    summary's validation accuracies are the whole run's (val_before/ of step 0 first)."""
    run_dir = tmp_path / "run"
    first = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--run-dir", str(run_dir), "--set", "steps=3",
         "--set", "checkpoint_every=1", "--set", "export_hf=false", "--set", "trace=false", "--set", "val_every=1",
         "--set", "val_prompts=8"],
        capture_output=True, text=True, timeout=240,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    newest = run_dir / "checkpoints" / "step_00000003"
    (newest / "state.json").write_text((newest / "state.json").read_text()[:20])  # cut short
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--resume", str(run_dir)],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"hfrt controller: warning: checkpoint {newest}: state.json is not readable JSON" in out.stderr
    previous = run_dir / "checkpoints" / "step_00000002"
    assert f"hfrt controller: warning: resuming from {previous} (step 2), the newest whole checkpoint" in out.stderr
    summary = json.loads(out.stdout)
    assert summary["resumed_from_step"] == 2
    assert [_step_of(line) for line in read_metrics(run_dir)] == [0, 1, 2]
    records = [json.loads(line) for line in read_metrics(run_dir)]
    assert summary["val_accuracy_first"] == records[0]["val_before/accuracy"]  # not the resumed part's first
    assert summary["val_accuracy_last"] == records[2]["val/accuracy"] and summary["steps"] == 3
    assert json.loads((newest / "state.json").read_text())["step"] == 3  # written whole again
