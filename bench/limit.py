"""How close hfrt's GRPO step is to its compute floor: hfrt's whole step on its daemons against the
same step's three compute stages done alone in one plain process (bench/limit_floor.py: vLLM's
generate, the reference forward, the update's forward + backward + optimizer step), interleaved in
one run (one hfrt step, then one floor step, ...), on the same model, prompts and shape.

Run: `hfrt bench limit [--model tiny|smollm2-135m|DIR] [--engine vllm|hf] [--steps N] [--warmup K]
[--prompts 8] [--n 4] [--max-new-tokens 16] [--prompt-prefix tools] [--json] [--out FILE]`.
Reported (medians over the measured steps): `step_s` (hfrt's step, wall), `floor_s` (the floor
step: the sum of its three stages), `overhead_ratio` = step_s / floor_s, `overhead_s`, each side's
stages, and `target_met` (overhead_ratio ≤ 1.10); and the same in CPU seconds (`step_cpu_s`: hfrt's
controller and daemons, `floor_cpu_s`: the floor process, `overhead_ratio_cpu`), which another
job on a shared machine moves far less than wall time. Both sides sample their own completions from the
same prompts (temperature 1), so the rows' lengths agree only in distribution: completion tokens
per step are reported for both. hfrt's daemons run the GRPO flow's defaults as `hfrt bench vs-trl`
sets them (fp32, one micro-batch, KL 0.001 as a loss, one optimizer step per rollout).
It knows the GRPO flow's step function and the stage names of its records; nothing of how either
side computes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hfrt.bench.common import StepProcess, add_output_flags, emit, machine
from hfrt.bench.vs_trl import Shape, hfrt_config, hfrt_roles, prompt_rows

#: hfrt's step at most this many times its floor
TARGET = 1.10
#: hfrt's record key (timing/...) → the floor's stage it is set against
STAGES = {"generate_s": "generate_s", "ref_log_prob_s": "reference_s", "update_s": "update_s"}


def floor_process(shape: Shape, engine: str, steps: int) -> StepProcess:
    """The floor's child process, one step per call (it waits for "stop" at the end)."""
    from hfrt.bench.limit_floor import floor_worker

    return StepProcess(floor_worker, (shape, engine, steps), what="floor", name="hfrt-bench-limit", stop="stop")


async def interleaved(ctl: Any, shape: Shape, steps: int, floor: StepProcess) -> dict[str, Any]:
    """`steps` hfrt GRPO steps, each followed by one floor step; every step's figures."""
    import asyncio

    from hfrt.bench.vs_trl_measure import ProcessCPU
    from hfrt.flows.batches import prompts_handle
    from hfrt.flows.recipes import grpo
    from hfrt.flows.trainer import get_roles

    cfg = hfrt_config(shape, steps)
    roles = await get_roles(ctl, "actor", "reference", "reward")
    ready = await asyncio.to_thread(floor.receive)
    rows = prompt_rows(shape, steps)
    ours, theirs = [], []
    cpu = ProcessCPU(exclude=floor.proc.pid)
    for step in range(steps):
        lo, hi = step * shape.prompts, (step + 1) * shape.prompts
        cpu0, start = cpu.seconds(), time.perf_counter()
        record = await grpo.grpo_step(cfg, step, prompts_handle({k: v[lo:hi] for k, v in rows.items()}), **roles)
        record["wall_s"] = time.perf_counter() - start
        record["cpu_s"] = cpu.seconds() - cpu0
        ours.append(record)
        theirs.append(await asyncio.to_thread(floor.step))
    return {"hfrt": ours, "floor": theirs, "floor_ready_s": ready["ready_s"]}


def measure(shape: Shape, steps: int, warmup: int, engine: str, heartbeat_s: float = 2.0) -> dict[str, Any]:
    """Start hfrt's daemons and the floor process, run warmup + steps interleaved steps, summarize."""
    from hfrt.flows import Flow
    from hfrt.session import run_flow
    from hfrt.wire.loop import run

    total = warmup + steps
    floor = floor_process(shape, engine, total)
    try:
        async def flow(ctl: Any, _config: dict[str, Any]) -> dict[str, Any]:
            return await interleaved(ctl, shape, total, floor)

        with tempfile.TemporaryDirectory(prefix="hfrt-bench-limit-") as run_dir:
            out = run(run_flow(Flow("bench-limit", flow, hfrt_roles(shape, engine)), run_dir=Path(run_dir), config={}, heartbeat_s=heartbeat_s))
    finally:
        floor.close()
    return summarize(out, warmup)


def summarize(out: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Medians over the measured steps: the step, the floor (per-step sum of its stages), their
    ratio, each side's stages and hfrt's stage over the floor's."""
    def med(values: Any) -> float:
        return round(statistics.median(list(values)), 4)

    ours, theirs = out["hfrt"][warmup:], out["floor"][warmup:]
    step_s = med(r["wall_s"] for r in ours)
    floor_s = med(sum(r[s] for s in STAGES.values()) for r in theirs)
    keys = sorted({k for r in ours for k in r if k.startswith(("timing/", "rollout/timing/"))})
    hfrt_stages = {k.replace("timing/", "", 1): med(r[k] for r in ours if k in r) for k in keys}
    floor_stages = {s: med(r[s] for r in theirs) for s in STAGES.values()}
    ratio = round(step_s / floor_s, 4)
    cpu = {}
    if all("cpu_s" in r for r in ours + theirs):  # CPU seconds: what the work costs whatever else the machine runs
        step_cpu, floor_cpu = med(r["cpu_s"] for r in ours), med(r["cpu_s"] for r in theirs)
        cpu = {"step_cpu_s": step_cpu, "floor_cpu_s": floor_cpu, "overhead_ratio_cpu": round(step_cpu / floor_cpu, 4)}
    return cpu | {
        "step_s": step_s, "floor_s": floor_s, "overhead_ratio": ratio, "overhead_s": round(step_s - floor_s, 4),
        "target": TARGET, "target_met": ratio <= TARGET,
        "floor_stages_s": floor_stages, "hfrt_stages_s": hfrt_stages,
        "stage_over_floor": {f: round(hfrt_stages[h] / floor_stages[f], 4) for h, f in STAGES.items() if h in hfrt_stages and floor_stages[f]},
        "hfrt_steps_s": [round(r["wall_s"], 3) for r in ours],
        "floor_steps_s": [round(sum(r[s] for s in STAGES.values()), 3) for r in theirs],
        "hfrt_tokens": med(r["response_tokens"] for r in ours), "floor_tokens": med(r["tokens"] for r in theirs),
        "floor_startup_s": round(out["floor_ready_s"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench limit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset (tiny, smollm2-135m) or a Hugging Face model folder")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"],
                   help="generation on both sides: vLLM (the floor calls LLM.generate) or hfrt's HF engine (the floor: transformers' generate)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per side (medians are over these)")
    p.add_argument("--warmup", type=int, default=1, help="steps per side run first and left out of the figures")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16, help="completion length limit")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of both sides")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: every core)")
    p.add_argument("--prompt-prefix", default="", choices=["", "tools"], help="text before every prompt: tools, a tool-schema system prompt")
    p.add_argument("--heartbeat-s", type=float, default=2.0,
                   help="daemon heartbeat interval (a daemon silent for a few intervals is declared gone): raise it on an overloaded machine")
    add_output_flags(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.prompts < 1 or args.n < 2 or args.max_new_tokens < 1:
        p.error("need --steps >= 1, --warmup >= 0, --prompts >= 1, --n >= 2 and --max-new-tokens >= 1")
    from hfrt.log import configure as configure_logging

    configure_logging("warning")
    shape = Shape(args.model, args.prompts, args.n, args.max_new_tokens, args.lr, threads=args.threads, prompt_prefix=args.prompt_prefix)
    load_start = [round(x, 2) for x in os.getloadavg()]
    result = measure(shape, args.steps, args.warmup, args.engine, args.heartbeat_s)
    result |= {"model": shape.model, "engine": args.engine, "steps": args.steps, "warmup": args.warmup, "shape": asdict(shape),
               **machine(), "load_avg_start": load_start}
    print(f"{'stage (s)':<20}{'hfrt':>10}{'floor':>10}")
    for ours, theirs in STAGES.items():
        print(f"{ours.removesuffix('_s'):<20}{result['hfrt_stages_s'].get(ours, '-'):>10}{result['floor_stages_s'][theirs]:>10}")
    print(f"{'step':<20}{result['step_s']:>10}{result['floor_s']:>10}")
    if "overhead_ratio_cpu" in result:
        print(f"{'step CPU seconds':<20}{result['step_cpu_s']:>10}{result['floor_cpu_s']:>10}")
    print(f"hfrt's step / floor: {result['overhead_ratio']} (target <= {TARGET}: {'met' if result['target_met'] else 'missed'}); "
          f"load average {load_start} -> {result['load_avg']}")
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
