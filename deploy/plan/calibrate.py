"""Fitting the planner's efficiency factors to a real run: `hfrt plan PLAN.toml --calibrate RUN_DIR`.

It reads RUN_DIR/config.json (the run's settings and roles) and RUN_DIR/metrics.jsonl (each
step's `timing/<stage>_s`), predicts each stage of that run with the cost model, and fits
1/efficiency per cost category plus the per-call cost by non-negative least squares, pulled gently
toward the current factors so a category the run never exercised keeps its value. It knows the
cost model's linear form; it does not search mappings or start runs.

A run's mapping is read from the cluster spec it ran with (`--calibrate RUN_DIR=SPEC`), or taken
as each model role on its own `world_size` devices, data-parallel (what `hfrt controller` without
--cluster starts). Several runs are fitted together.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.deploy.plan.file import FUNCTION, PlanInput, resolve_model
from hfrt.deploy.plan.model import CATEGORIES, Cost, Efficiency, Layout, ModelSpec
from hfrt.deploy.plan.search import Choice, Problem, auto_parallel

WARMUP_STEPS = 2
RIDGE = 1e-6
MIN_FRACTION = 1e-3


@dataclass(frozen=True)
class Fit:
    """The fitted factors, and per stage the measured median and the prediction before and after."""

    efficiency: Efficiency
    stages: dict[str, tuple[float, float, float]]
    steps_used: int


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    try:
        config = json.loads((run_dir / "config.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise ValueError(f"--calibrate {run_dir}: cannot read config.json and metrics.jsonl there ({exc})") from None
    rows = [r for r in rows if any(k.startswith("timing/") for k in r)]
    if len(rows) <= WARMUP_STEPS:
        raise ValueError(f"--calibrate {run_dir}: {len(rows)} steps with timings; need more than {WARMUP_STEPS}")
    return config, rows


def run_problem(plan: PlanInput, config: dict[str, Any]) -> tuple[Problem, dict[str, int]]:
    """The plan's problem with the run's models, workload settings and world sizes."""
    flow_cfg = config.get("flow", {})
    w = plan.problem.workload
    read = _flow_config(plan.flow, flow_cfg)
    w = dataclasses.replace(
        w, prompts_per_step=int(read.get("prompts_per_step", w.prompts_per_step)),
        samples_per_prompt=int(read.get("n", 1)), response_len=int(read.get("max_new_tokens", w.response_len)),
        ppo_epochs=int(read.get("ppo_epochs", w.ppo_epochs)),
    )
    roles = config.get("roles", {})
    models: dict[str, ModelSpec] = {}
    sizes = {}
    for role in plan.problem.models:
        options = roles.get(role, {}).get("options", {})
        source = options.get("model", plan.model_sources.get(role, ""))
        if options.get("kind") == FUNCTION:
            continue
        models[role] = _model_for(plan, role, source)
        sizes[role] = int(roles.get(role, {}).get("world_size", 1))
    stages = tuple(dataclasses.replace(s, calls={r: o for r, o in s.calls.items() if r in models}) for s in plan.problem.stages)
    return dataclasses.replace(plan.problem, models=models, stages=stages, workload=w), sizes


def _flow_config(flow: str, given: dict[str, Any]) -> dict[str, Any]:
    """The run's flow settings with the flow Config's defaults filled in."""
    from hfrt.flows import load_flow

    cls = load_flow(flow).config_cls
    if cls is None:
        return dict(given)
    return dataclasses.asdict(cls.read({k: v for k, v in given.items() if k != "resume"}))


def _model_for(plan: PlanInput, role: str, source: str) -> ModelSpec:
    if not source or source == plan.model_sources.get(role):
        return plan.problem.models[role]
    return resolve_model(source, role, plan.source)


def run_mapping(p: Problem, sizes: dict[str, int], spec: str | None) -> tuple[list[tuple[str, ...]], dict[str, Layout]]:
    """The run's colocated sets and layouts: from the cluster spec it ran with, else each role on
    its own world_size devices, data-parallel (`hfrt controller` without --cluster)."""
    if spec is None:
        return [(r,) for r in p.models], {r: Layout(1, 1, sizes[r]) for r in p.models}
    from hfrt.deploy.spec import load_spec

    cluster = load_spec(spec)
    missing = sorted(set(p.models) - set(cluster.roles))
    if missing:
        raise ValueError(f"--calibrate: spec {spec} does not place role(s) {missing}")
    pools: dict[str, list[str]] = {}
    layouts = {}
    for role in p.models:
        placed = cluster.roles[role]
        pools.setdefault(placed.pool, []).append(role)
        layouts[role] = Layout(placed.pp_size, placed.tp_size, placed.dp_size)
    return [tuple(g) for g in pools.values()], layouts


def run_choices(p: Problem, layouts: dict[str, Layout]) -> dict[str, Choice]:
    """Each role's costs under the layout it ran with (memory is not checked: it did run)."""
    out = {}
    for role, lay in layouts.items():
        c = auto_parallel(p, role, lay.devices, p.hw.memory_bytes * 1e6, [lay])
        if c is None:
            raise ValueError(f"--calibrate: role {role!r} cannot run as pp {lay.pp} tp {lay.tp} dp {lay.dp} in the cost model")
        out[role] = c
    return out


def stage_costs(p: Problem, sets: list[tuple[str, ...]], choices: dict[str, Choice]) -> list[Cost]:
    """Each stage's critical path under the current efficiencies: the slowest set's summed cost."""
    out = []
    for i in range(len(p.stages)):
        per_set = [sum((choices[r].costs[i] for r in g), Cost()) for g in sets]
        out.append(max(per_set, key=lambda c: c.seconds(p.eff), default=Cost()))
    return out


def run_rows(plan: PlanInput, run: str) -> tuple[list[list[float]], list[float], list[str], int]:
    """One run's fitting rows: per stage with a timing, the raw cost vector and the median time.
    `run` is RUN_DIR, or RUN_DIR=SPEC for a run started with --cluster SPEC."""
    run_dir, _, spec = run.partition("=")
    config, rows = read_run(Path(run_dir))
    p, sizes = run_problem(plan, config)
    sets, layouts = run_mapping(p, sizes, spec or None)
    costs = stage_costs(p, sets, run_choices(p, layouts))
    used = rows[WARMUP_STEPS:]
    xs, ys, names = [], [], []
    for stage, cost in zip(p.stages, costs, strict=True):
        values = [r[f"timing/{stage.name}_s"] for r in used if f"timing/{stage.name}_s" in r]
        if values and cost.calls:
            xs.append([getattr(cost, c) for c in CATEGORIES] + [cost.calls])
            ys.append(statistics.median(values))
            names.append(stage.name)
    if not xs:
        raise ValueError(f"--calibrate {run_dir}: no timing/<stage>_s of flow {plan.flow!r} ({', '.join(s.name for s in p.stages)})")
    return xs, ys, names, len(used)


def calibrate(plan: PlanInput, runs: str | list[str]) -> Fit:
    """Fit the efficiency factors to one or more runs (stage medians after the warm-up steps)."""
    runs = [runs] if isinstance(runs, str) else runs
    xs: list[list[float]] = []
    ys: list[float] = []
    names: list[str] = []
    steps = 0
    for run in runs:
        run_xs, run_ys, run_names, used = run_rows(plan, str(run))
        prefix = f"{Path(str(run).partition('=')[0]).name}/" if len(runs) > 1 else ""
        xs, ys, names, steps = xs + run_xs, ys + run_ys, names + [prefix + s for s in run_names], steps + used
    e = plan.problem.eff
    prior = [1 / getattr(e, c) for c in CATEGORIES] + [e.call_s]
    fitted = nnls_ridge(xs, ys, prior)
    eff = Efficiency(**{c: 1 / max(v, 1e-9) for c, v in zip(CATEGORIES, fitted, strict=False)}, call_s=fitted[-1])
    stages = {}
    for x, y, n in zip(xs, ys, names, strict=True):
        before = sum(a * b for a, b in zip(x, prior, strict=True))
        stages[n] = (y, before, sum(a * b for a, b in zip(x, fitted, strict=True)))
    return Fit(eff, stages, steps)


def nnls_ridge(xs: list[list[float]], ys: list[float], prior: list[float], sweeps: int = 500) -> list[float]:
    """argmin over v >= floor (v_k >= prior_k / 1000, call_s >= 0) of sum_i (x_i·v - y_i)^2 / y_i^2 + RIDGE * sum_k ((v_k - prior_k) / prior_k)^2,
    by coordinate descent (relative errors: every stage counts alike). Columns that are zero
    everywhere keep their prior."""
    v = list(prior)
    floor = [p * MIN_FRACTION for p in prior[:-1]] + [0.0]  # an efficiency at most 1000x its prior; call_s may be 0
    weights = [1 / max(y, 1e-12) ** 2 for y in ys]
    for _ in range(sweeps):
        for k in range(len(v)):
            col = [x[k] for x in xs]
            if not any(col):
                continue
            scale = max(prior[k], 1e-12)
            a = sum(w * c * c for w, c in zip(weights, col, strict=True)) + RIDGE / scale**2
            resid = [y - sum(x[j] * v[j] for j in range(len(v)) if j != k) for x, y in zip(xs, ys, strict=True)]
            b = sum(w * c * r for w, c, r in zip(weights, col, resid, strict=True)) + RIDGE * prior[k] / scale**2
            v[k] = max(floor[k], b / a)
    return v
