"""`hfrt plan PLAN.toml`: run the device-mapping search and show the top mappings as a table or
one JSON line, optionally write the best as a cluster spec (--out) and fit the cost model to a
real run first (--calibrate RUN_DIR).

It formats and writes; the search is deploy.plan, the file format deploy.plan_file, the spec
writer deploy.plan_spec and the fit deploy.plan_calibrate. No torch is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from hfrt.deploy.plan.file import PlanInput, load_plan
from hfrt.deploy.plan.search import Mapping, Result, search
from hfrt.deploy.plan.spec import pool_names, spec_text
from hfrt.deploy.reader import SpecError

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="PLAN.toml: flow, models, workload, cluster (see docs/plan.md)")
    p.add_argument("--out", metavar="SPEC", help="write the best mapping as a cluster spec TOML (for --cluster / hfrt launch)")
    p.add_argument("--rank", type=int, default=1, metavar="N", help="with --out: write the N-th best mapping instead (1 = best)")
    p.add_argument("--top", type=int, default=0, metavar="K", help="how many mappings to show (default: the PLAN's top, else 5)")
    p.add_argument("--json", action="store_true", help="print one JSON line (best, predicted_step_s, candidates_evaluated, plan_s, ...)")
    p.add_argument("--calibrate", action="append", default=[], metavar="RUN_DIR[=SPEC]",
                   help="first fit the efficiency factors to a run's metrics.jsonl timings; =SPEC: the cluster spec it ran with (repeatable)")


def main(args: argparse.Namespace) -> int:
    try:
        plan = load_plan(args.plan)
        fit = None
        if args.calibrate:
            from hfrt.deploy.plan.calibrate import calibrate

            fit = calibrate(plan, args.calibrate)
            plan = dataclasses.replace(plan, problem=dataclasses.replace(plan.problem, eff=fit.efficiency))
    except (SpecError, ValueError) as exc:
        print(f"hfrt plan: {exc}", file=sys.stderr)
        return 2
    result = search(plan.problem)
    if not result.ranked:
        print(f"hfrt plan: no mapping fits: every placement needs more memory than {plan.problem.devices} "
              f"{plan.problem.hw.name} devices have ({plan.problem.hw.memory_bytes / GB:.0f} GB each)", file=sys.stderr)
        return 1
    top = args.top or plan.top
    if args.out:
        if not 1 <= args.rank <= len(result.ranked):
            print(f"hfrt plan: --rank {args.rank}: only {len(result.ranked)} mappings were found", file=sys.stderr)
            return 2
        Path(args.out).write_text(spec_text(plan, result.ranked[args.rank - 1]))
    if args.json:
        print(json.dumps(summary(plan, result, top, fit, args.out)))
    else:
        print(table(plan, result, top))
        if fit is not None:
            print(calibration_text(fit))
        if args.out:
            print(f"wrote {args.out} (mapping #{args.rank}); run it with: hfrt controller --cluster {args.out} --flow {plan.flow}")
    return 0


def mapping_dict(plan: PlanInput, m: Mapping) -> dict[str, Any]:
    """One mapping as JSON: sets with their devices and memory, each role's layout, stage times."""
    p = plan.problem
    sets = []
    for pool, group, n, mem in zip(pool_names(m), m.placement, m.alloc, m.memory, strict=True):
        roles: dict[str, dict[str, Any]] = {}
        for r in group:
            c = m.choices[r]
            roles[r] = {"pp": c.layout.pp, "tp": c.layout.tp, "dp": c.layout.dp}
            if c.gen is not None:
                roles[r]["generate"] = {"pp": c.gen.pp, "tp": c.gen.tp, "dp": c.gen.dp}
        sets.append({"pool": pool, "roles": roles, "devices": n, "memory_gb": round(mem.peak / GB, 3)})
    return {
        "sets": sets, "step_s": round(m.step_s, 6),
        "stage_s": {s.name: round(t, 6) for s, t in zip(p.stages, m.stage_s, strict=True)},
    }


def summary(plan: PlanInput, result: Result, top: int, fit: Any, out: str | None) -> dict[str, Any]:
    best = result.ranked[0]
    data: dict[str, Any] = {
        "flow": plan.flow, "devices": plan.problem.devices, "hardware": plan.problem.hw.name,
        "best": mapping_dict(plan, best), "predicted_step_s": round(best.step_s, 6),
        "candidates_evaluated": result.candidates_evaluated, "plan_s": round(result.plan_s, 4),
        "top": [mapping_dict(plan, m) for m in result.ranked[:top]],
        "infeasible_placements": result.infeasible,
        "efficiency": dataclasses.asdict(plan.problem.eff),
    }
    if fit is not None:
        data["calibration"] = {"steps": fit.steps_used, "stages": {
            n: {"measured_s": m, "predicted_before_s": b, "predicted_after_s": a} for n, (m, b, a) in fit.stages.items()}}
    if out:
        data["out"] = out
    return data


def table(plan: PlanInput, result: Result, top: int) -> str:
    p = plan.problem
    names = [s.name for s in p.stages]
    head = f"{'#':>2}  {'placement (devices)':<44} {'layouts: pp×tp×dp [gen tp×dp]':<44} " + " ".join(f"{n[:12]:>12}" for n in names)
    lines = [
        f"hfrt plan: flow {plan.flow} on {p.nodes}×{p.per_node} {p.hw.name}; {result.candidates_evaluated} allocations "
        f"evaluated in {result.plan_s:.2f} s; step times in seconds",
        head + f" {'step':>10} {'GB/device':>10}",
    ]
    for i, m in enumerate(result.ranked[:top], 1):
        sets = " | ".join(f"{'+'.join(g)} ({n})" for g, n in zip(m.placement, m.alloc, strict=True))
        lays = " ".join(_layout(r, m) for g in m.placement for r in g)
        mem = max(x.peak for x in m.memory) / GB
        lines.append(f"{i:>2}  {sets:<44} {lays:<44} " + " ".join(f"{t:>12.3f}" for t in m.stage_s)
                     + f" {m.step_s:>10.3f} {mem:>10.2f}")
    if result.infeasible:
        lines.append(f"not feasible: {'; '.join(result.infeasible)}")
    return "\n".join(lines)


def _layout(role: str, m: Mapping) -> str:
    c = m.choices[role]
    text = f"{role[:6]} {c.layout.pp}×{c.layout.tp}×{c.layout.dp}"
    return text + (f" [{c.gen.tp}×{c.gen.dp}]" if c.gen is not None else "")


def calibration_text(fit: Any) -> str:
    e = fit.efficiency
    lines = [f"calibrated on {fit.steps_used} steps (stage: measured / predicted before → after, seconds):"]
    lines += [f"  {n}: {m:.4f} / {b:.4f} → {a:.4f}" for n, (m, b, a) in fit.stages.items()]
    lines.append("[efficiency]   # paste into PLAN.toml to keep these factors")
    lines += [f"{f.name} = {getattr(e, f.name):.6g}" for f in dataclasses.fields(e)]
    return "\n".join(lines)
