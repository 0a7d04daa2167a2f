"""Controller memory benchmark: the controller's resident memory (RSS) over a long PPO run on the
tiny preset, to show it stays flat (no per-call or per-step growth in the controller).

Run: `hfrt bench memory [--steps N] [--every K] [--json] [--out FILE]`. It runs the built-in PPO
flow as `hfrt controller --flow ppo` would (fresh local daemons, a real run folder with
metrics.jsonl, TensorBoard and the call trace; no progress bar, no HF export), and samples this
process's VmRSS (from /proc/self/status) every K steps. It reports RSS at step 100 (after warm-up)
and at the last step, the growth between them in percent, the calls the controller sent, and
every sample. It knows the PPO flow's step function; nothing of what a step computes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine
from hfrt.flows import Flow
from hfrt.flows.recipes import ppo
from hfrt.flows.trainer import Trainer, get_roles
from hfrt.log import configure as configure_logging
from hfrt.session import run_flow
from hfrt.wire.loop import run

#: the step whose RSS is the baseline: start-up and the first steps' caches are done by then
BASELINE_STEP = 100


def rss_mb() -> float:
    """This process's resident set size in MiB (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def memory_flow(steps: int, every: int, run_dir: Path) -> Flow:
    """PPO for `steps` steps through its Trainer; after every `every`-th step (and step 100 and
    the last), one (step, RSS MiB, calls sent) sample."""

    async def measure(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        cfg = ppo.Config.read({"steps": steps, "run_dir": str(run_dir), "progress": "off", "export_hf": False})
        roles = await get_roles(ctl, *ppo.ROLES)
        samples: list[dict[str, float]] = []
        started = time.perf_counter()

        async def step(index: int, prompts: Any) -> dict[str, Any]:
            record = await ppo.ppo_step(cfg, index, prompts, **roles)
            done = index + 1
            if done % every == 0 or done in (1, BASELINE_STEP, steps):
                samples.append({"step": done, "rss_mb": round(rss_mb(), 2), "calls": ctl.stats()["calls_sent"],
                                "elapsed_s": round(time.perf_counter() - started, 1)})
            return record

        await Trainer(ctl, cfg, roles, trained=("actor", "critic")).run(step)
        return {"samples": samples}

    return Flow("bench-memory", measure, ppo.ROLES)


def summarize(samples: list[dict[str, float]], steps: int) -> dict[str, Any]:
    by_step = {int(s["step"]): s for s in samples}
    base = by_step.get(BASELINE_STEP, samples[0])
    last = by_step[steps]
    calls = last["calls"] - base["calls"]
    growth = last["rss_mb"] - base["rss_mb"]
    return {
        "steps": steps, "baseline_step": int(base["step"]),
        "rss_baseline_mb": base["rss_mb"], "rss_last_mb": last["rss_mb"],
        "growth_pct": round(100 * growth / base["rss_mb"], 2),
        "bytes_per_call": round(growth * 2**20 / calls, 1) if calls else None,
        "calls": int(last["calls"]), "step_s": round(last["elapsed_s"] / steps, 4),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="PPO steps to run (at least 100)")
    p.add_argument("--every", type=int, default=250, help="sample RSS every this many steps")
    add_output_flags(p)
    args = p.parse_args(argv)
    if args.steps < BASELINE_STEP or args.every < 1:
        p.error(f"--steps must be >= {BASELINE_STEP} and --every >= 1")
    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="hfrt-bench-memory-") as tmp:
        out = run(run_flow(memory_flow(args.steps, args.every, Path(tmp) / "run"), run_dir=Path(tmp) / "run", config={}))
    result = {"bench": "memory", "flow": "ppo", "preset": "tiny", **summarize(out["samples"], args.steps), **machine()}
    for s in result["samples"]:
        print(f"step {int(s['step']):>6}  rss {s['rss_mb']:8.1f} MiB  calls {int(s['calls']):>8}", file=sys.stderr)
    print(f"rss at step {result['baseline_step']}: {result['rss_baseline_mb']} MiB, at step {args.steps}: "
          f"{result['rss_last_mb']} MiB ({result['growth_pct']:+.2f}%)", file=sys.stderr)
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
