"""What one elastic recovery costs: a local run (`hfrt controller --set recovery=on`) whose daemon
of one role is killed with kill -9 every few steps; prints, per kill, the time from the death to
the replacement being ready (`replace_s`, from the recovery log) and the flow time lost
(`lost_s`: the growth of metrics' recovery/lost_s over the steps after the kill), then medians,
with the run's median step time as the reference (the box's load shifts both alike).

    python -m bench.recovery_cost --role reward --kills 3
    python -m bench.recovery_cost --role actor --kills 3          # checkpoint_every=2: rewinds
    python -m bench.recovery_cost --flow grpo_async --role rollout

It knows the command line and metrics.jsonl; nothing of how recovery works inside.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPLACED = re.compile(r"daemon_replaced\s+.*?after_s=([\d.]+)")


def steps_done(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def daemon_of(run: subprocess.Popen[str], role: str) -> psutil.Process:
    """The live daemon process of `role` (rank 0) under the controller `run`."""
    for child in psutil.Process(run.pid).children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "--role" in argv and argv[argv.index("--role") + 1] == role and child.status() != psutil.STATUS_ZOMBIE:
            return child
    raise LookupError(f"no live {role} daemon under pid {run.pid}")


def wait_steps(run: subprocess.Popen[str], run_dir: Path, n: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps_done(run_dir)) < n:
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run stopped before step {n}: {run.communicate()[1][-2000:]}")
        time.sleep(0.05)


def measure(flow: str, role: str, kills: int, every: int, heartbeat_s: float) -> dict[str, Any]:
    steps = (kills + 1) * every + 2
    with tempfile.TemporaryDirectory(prefix="hfrt-recovery-cost-") as tmp:
        run_dir = Path(tmp) / "run"
        argv = [sys.executable, "-m", "hfrt", "controller", "--flow", flow, "--run-dir", str(run_dir),
                "--heartbeat", str(heartbeat_s), "--set", "recovery=on", "--set", f"recovery_max_restarts={kills + 1}",
                "--set", f"steps={steps}", "--set", "export_hf=false", "--set", "trace=false", "--set", "tensorboard=false"]
        if role in ("actor", "critic"):
            argv += ["--set", "checkpoint_every=2"]
        run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lost: list[float] = []
        try:
            for k in range(kills):
                at = (k + 1) * every
                wait_steps(run, run_dir, at)
                before = steps_done(run_dir)[-1]["recovery/lost_s"]
                proc = daemon_of(run, role)
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
                wait_steps(run, run_dir, at + every - 1)
                lost.append(steps_done(run_dir)[-1]["recovery/lost_s"] - before)
            _, err = run.communicate(timeout=600)
            step_s = statistics.median(r.get("timing/step_s", 0.0) for r in steps_done(run_dir))
        finally:
            if run.poll() is None:
                run.kill()
        if run.returncode != 0:
            raise RuntimeError(f"the run failed: {err[-2000:]}")
        replace = [float(m) for m in REPLACED.findall(err)]
    return {"flow": flow, "role": role, "replace_s": replace, "lost_s": [round(x, 2) for x in lost],
            "median_replace_s": statistics.median(replace) if replace else None,
            "median_lost_s": statistics.median(lost) if lost else None,
            "median_step_s": round(step_s, 3)}  # the same run's undisturbed pace, for ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench recovery", description=__doc__.splitlines()[0])
    p.add_argument("--flow", default="ppo", help="flow to run (ppo, grpo_async, ...)")
    p.add_argument("--role", default="reward", help="role whose daemon is killed")
    p.add_argument("--kills", type=int, default=3, help="how many times to kill it")
    p.add_argument("--every", type=int, default=4, help="steps between kills")
    p.add_argument("--heartbeat", type=float, default=2.0, help="daemon heartbeat interval (s)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.flow, args.role, args.kills, args.every, args.heartbeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
