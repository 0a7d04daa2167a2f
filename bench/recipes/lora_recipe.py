"""The LoRA recipe of docs/real-models.md, measured: GRPO on SmolLM2-135M on the addition task with
LoRA adapters (bench/recipes/smollm2-math-lora.toml) and, for comparison, the full-fine-tuning
recipe (bench/recipes/smollm2-math.toml), each run with `hfrt controller` as a user runs it.

`python -m hfrt.bench.recipes.lora_recipe --work runs/lora-recipe --out bench/results/lora-recipe.json
[--lora-steps 20] [--full-steps 3] [--skip-full]`

Reported per run: greedy held-out accuracy before training and after (the flow's validation
passes, `val_before/accuracy` and the last `val/accuracy`), the median step time and stage times
over the steps after the first, the wall time, and the peak resident memory (VmHWM) of every
daemon process, sampled from /proc while the run lasts. The full run may be shortened
(`--full-steps`): its step time and memory are what it is compared on. It runs the CLI as a user
does; it knows the recipes' files and the run folder's layout, nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

RECIPES = Path(__file__).resolve().parent
#: the full-fine-tuning run takes the LoRA recipe's memory settings, so step time and memory compare
SAME_AS_LORA = ("roles.actor.options.engine.micro_batch_size=16", "roles.reference.options.engine.micro_batch_size=16",
                "roles.actor.options.vllm.max_model_len=128", "roles.actor.options.vllm.max_num_seqs=64")


class DaemonMemory:
    """Polls RUN_DIR/logs/daemons.pids and each daemon's /proc/PID/status VmHWM (its lifetime peak
    RSS) every `interval_s` until stopped; `.peaks` maps "role-rank" to MiB."""

    def __init__(self, run_dir: Path, interval_s: float = 1.0) -> None:
        self.pids_file = run_dir / "logs" / "daemons.pids"
        self.interval_s = interval_s
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="daemon-memory", daemon=True)

    def __enter__(self) -> DaemonMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                pids = [int(p) for p in self.pids_file.read_text().split()]
            except (OSError, ValueError):
                continue
            for pid in pids:
                sample = _peak(pid)
                if sample is not None:
                    name, mib = sample
                    self.peaks[name] = max(self.peaks.get(name, 0.0), mib)


def _peak(pid: int) -> tuple[str, float] | None:
    """("role-rank", VmHWM MiB) of a running hfrt daemon, or None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    if "--role" not in argv:
        return None
    name = f"{argv[argv.index('--role') + 1]}-{argv[argv.index('--rank') + 1] if '--rank' in argv else 0}"
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return name, int(line.split()[1]) / 1024
    return None


def run(config: Path, run_dir: Path, steps: int | None, extra: list[str]) -> dict[str, Any]:
    """One `hfrt controller --flow grpo` run: its summary, per-step records, wall time, daemon peaks."""
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--config", str(config),
            "--run-dir", str(run_dir), "--set", "progress=off"]
    if steps is not None:
        args += ["--set", f"steps={steps}"]
    for item in extra:
        args += ["--set", item]
    start = time.perf_counter()
    with DaemonMemory(run_dir) as memory:
        done = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"records": records, "wall_s": round(wall, 1), "daemon_peak_rss_mib": {k: round(v, 1) for k, v in sorted(memory.peaks.items())}}


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Accuracy before / after, median step and stage times over steps after the first, memory."""
    records = out["records"]
    before = next((r["val_before/accuracy"] for r in records if "val_before/accuracy" in r), None)
    vals = [(r.get("step"), r["val/accuracy"]) for r in records if "val/accuracy" in r]
    steady = records[1:] or records
    stages = sorted({k for r in steady for k in r if k.startswith("timing/") and isinstance(r[k], (int, float))})
    return {
        "steps": len(records), "val_accuracy_before": before, "val_accuracy": vals,
        "val_accuracy_after": vals[-1][1] if vals else None,
        "train_accuracy_first_last": [records[0].get("reward/accuracy", records[0].get("reward/mean")),
                                      records[-1].get("reward/accuracy", records[-1].get("reward/mean"))],
        "median_step_s": round(statistics.median(r["timing/step_s"] for r in steady if "timing/step_s" in r), 2)
        if any("timing/step_s" in r for r in steady) else None,
        "median_stage_s": {k.removeprefix("timing/"): round(statistics.median(r[k] for r in steady if k in r), 2) for k in stages},
        "wall_s": out["wall_s"], "daemon_peak_rss_mib": out["daemon_peak_rss_mib"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.lora_recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/lora-recipe", help="folder for the data and the run folders")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--lora-steps", type=int, default=None, help="steps of the LoRA run (default: the recipe's)")
    p.add_argument("--full-steps", type=int, default=3, help="steps of the full-fine-tuning run (its step time and memory)")
    p.add_argument("--skip-full", action="store_true", help="run the LoRA recipe only")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to the LoRA run's controller")
    args = p.parse_args(argv)
    from hfrt.bench.common import machine
    from hfrt.bench.recipes.make_math_data import write

    work = Path(args.work)
    train, val = write(work / "math", 600, 100, 0)
    data = [f"data={train}", f"val_data={val}"]
    result: dict[str, Any] = {"lora": summarize(run(RECIPES / "smollm2-math-lora.toml", work / "lora", args.lora_steps, data + args.set))}
    print(json.dumps(result["lora"]), flush=True)
    if not args.skip_full:
        full = summarize(run(RECIPES / "smollm2-math.toml", work / "full", args.full_steps, data + ["val_every=0", *SAME_AS_LORA]))
        result["full"] = full
        result["lora_vs_full"] = {
            "step_time_ratio": round(result["lora"]["median_step_s"] / full["median_step_s"], 3),
            "actor_peak_rss_ratio": round(result["lora"]["daemon_peak_rss_mib"].get("actor-0", 0.0)
                                          / max(full["daemon_peak_rss_mib"].get("actor-0", 1.0), 1.0), 3),
            "total_peak_rss_mib": {"lora": round(sum(result["lora"]["daemon_peak_rss_mib"].values()), 1),
                                   "full": round(sum(full["daemon_peak_rss_mib"].values()), 1)},
        }
    result |= machine()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
