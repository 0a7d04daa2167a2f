"""SIGTERM and SIGINT to commands that start daemons, as real processes get them: every daemon
stops, the summary is printed, the exit code is 128 + the signal, Ctrl-C prints one line (no
KeyboardInterrupt traceback), and `hfrt serve-openai` in the background stops on SIGTERM."""

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

pytestmark = pytest.mark.timeout(180)

HFRT = [sys.executable, "-m", "hfrt"]


def start(args: list[str], *, sigint: bool = True) -> subprocess.Popen[str]:
    """A command in a session of its own (as `setsid` or a terminal's job would have it), with
    SIGINT at its default action unless `sigint` is False (ignored: a background job)."""
    handler = signal.SIG_DFL if sigint else signal.SIG_IGN
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, handler))


def daemons_of(proc: subprocess.Popen[str], count: int, timeout_s: float = 60.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        kids = [k for k in psutil.Process(proc.pid).children(recursive=True) if "daemon" in " ".join(k.cmdline())]
        if len(kids) >= count:
            STARTED_PIDS.update(k.pid for k in kids)
            return kids
        assert proc.poll() is None and time.monotonic() < deadline, f"{count} daemons never started: {proc.communicate()}"
        time.sleep(0.1)


def wait_until(predicate: object, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - start


def alive(procs: list[psutil.Process]) -> list[int]:
    return [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_sigterm_to_a_local_ppo_run_stops_its_daemons_prints_the_summary_and_exits_143(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run = start([*HFRT, "controller", "--flow", "ppo", "--run-dir", str(run_dir), "--set", "steps=100000",
                 "--set", "export_hf=false", "--set", "tensorboard=false", "--set", "progress=off"])
    try:
        daemons = daemons_of(run, 4)
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, 150)
        sent = time.monotonic()
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=60)
        took = time.monotonic() - sent
        gone = wait_until(lambda: not alive(daemons), 5)
    finally:
        run.kill()
    print(f"SIGTERM to exit: {took:.2f}s, daemons gone {gone:.2f}s later")
    assert run.returncode == 128 + signal.SIGTERM, err[-3000:]
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGTERM" and summary["steps"] >= 2 and summary["metrics"] == str(metrics)
    assert "Traceback" not in err and took < 20


def test_ctrl_c_prints_one_line_and_exits_130_with_every_daemon_stopped(tmp_path: Path) -> None:
    run = start([*HFRT, "controller", "--flow", "ping", "--set", "rounds=1000000000", "--run-dir", str(tmp_path / "run")])
    try:
        daemons = daemons_of(run, 2)
        time.sleep(1.0)  # the flow is calling
        os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, err = run.communicate(timeout=30)
        wait_until(lambda: not alive(daemons), 5)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert err.strip().splitlines() == ["hfrt controller: SIGINT: stopping (the daemons it started are shut down)"]
    assert json.loads(out)["stopped_by"] == "SIGINT"


@pytest.mark.slow
def test_serve_openai_started_in_the_background_stops_on_sigterm(tmp_path: Path) -> None:
    server = start([*HFRT, "serve-openai", "--model", "tiny", "--port", "0", "--run-dir", str(tmp_path / "run")], sigint=False)
    try:
        daemons = daemons_of(server, 1)
        assert server.stdout is not None
        while "serving" not in (line := server.stdout.readline()):
            assert line, f"serve-openai ended before serving: {server.communicate()}"
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        wait_until(lambda: not alive(daemons), 5)
    finally:
        server.kill()
    assert server.returncode == 128 + signal.SIGTERM


@pytest.mark.slow
def test_sigterm_to_a_cluster_run_stops_the_daemons_it_launched(tmp_path: Path) -> None:
    spec = tmp_path / "local.toml"
    spec.write_text('name = "sig"\n[daemons]\nhello_timeout_s = 60\n[[nodes]]\nname = "localhost"\ndevices = 2\n'
                    '[roles.echo]\nimpl = "echo"\nworld_size = 2\n')
    run = start([*HFRT, "controller", "--cluster", str(spec), "--flow", "ping", "--set", "rounds=1000000000",
                 "--run-dir", str(tmp_path / "run")])
    try:
        daemons = daemons_of(run, 2)
        time.sleep(1.0)
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=30)
        wait_until(lambda: not alive(daemons), 5)
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGTERM, err
    assert json.loads(out)["stopped_by"] == "SIGTERM" and "Traceback" not in err
