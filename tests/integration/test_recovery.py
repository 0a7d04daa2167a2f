"""Elastic recovery (`--set recovery=on`), with real processes on the tiny preset: a reward or
reference daemon killed with kill -9 mid-run is relaunched and the run finishes every step once;
a role whose replacements crash on start ends the run with an error naming it and its log lines,
leaving nothing running."""

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

from hfrt import shm
from tests.support import STARTED_PIDS


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def start_run(run_dir: Path, *sets: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--run-dir", str(run_dir),
            "--set", "recovery=on", "--set", "export_hf=false", "--set", "trace=false", "--set", "tensorboard=false",
            "--heartbeat", "1.0", "--orphan-timeout", "5"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def daemon_of(run: subprocess.Popen[str], role: str) -> psutil.Process:
    """The live daemon process of `role` (rank 0) under the controller `run`."""
    for child in psutil.Process(run.pid).children(recursive=True):
        STARTED_PIDS.add(child.pid)
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "--role" in argv and argv[argv.index("--role") + 1] == role and child.status() != psutil.STATUS_ZOMBIE:
            return child
    raise LookupError(f"no live {role} daemon under pid {run.pid}")


def wait_for_step(run: subprocess.Popen[str], run_dir: Path, step: int, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps_done(run_dir)) < step and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.poll() is None, f"the run ended before step {step}: {run.communicate()[1][-3000:]}"
    assert len(steps_done(run_dir)) >= step, f"step {step} not reached within {timeout_s:.0f}s"


def kill_9(run: subprocess.Popen[str], role: str) -> int:
    proc = daemon_of(run, role)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return proc.pid


def descendants(run: subprocess.Popen[str]) -> list[psutil.Process]:
    try:
        return psutil.Process(run.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_reward_and_reference_killed_mid_run_are_replaced_and_the_run_finishes(tmp_path: Path) -> None:
    run_dir, steps = tmp_path / "run", 20
    run = start_run(run_dir, f"steps={steps}")
    killed: list[int] = []
    try:
        wait_for_step(run, run_dir, 5)
        killed.append(kill_9(run, "reward"))
        wait_for_step(run, run_dir, 12)
        killed.append(kill_9(run, "reference"))
        out, err = run.communicate(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps)), "a step was lost or repeated"
    assert records[-1]["recovery/restarts"] == 2
    assert records[0]["recovery/restarts"] == 0
    summary = json.loads(out)
    assert len(summary["recovery_replace_s"]) == 2
    for pid in killed:
        assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{pid}-*")), f"killed daemon {pid} left /dev/shm files"
    assert not [p for p in descendants(run) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_role_that_crashes_on_every_restart_ends_the_run_naming_it(tmp_path: Path) -> None:
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def score(prompt, response, **kw):\n    return 0.0\n")
    run_dir = tmp_path / "run"
    run = start_run(run_dir, "steps=200", "recovery_max_restarts=2", "roles.reward.options.function=" + f"{reward_file}:score")
    try:
        wait_for_step(run, run_dir, 2)
        reward_file.write_text("raise SystemExit('my_reward: broken on purpose')\n")
        first = kill_9(run, "reward")
        _, err = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert "role 'reward' keeps dying: 2 restarts" in err, err[-3000:]
    assert "broken on purpose" in err, "the error does not show the daemon's last log lines"
    assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{first}-*"))
    assert not [p for p in descendants(run) if p.is_running()], "daemons left running"
