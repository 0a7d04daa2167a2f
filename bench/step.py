"""Step benchmark: whole RL steps of the built-in flows (tiny preset, built-in addition task) on
their default local daemons, and how much of stage 2 (critic values ∥ reference log-probs ∥
reward) overlaps.

Run: `hfrt bench step [--steps N] [--warmup K] [--flows ppo,grpo] [--rounds R] [--json] [--out FILE]`.
Each flow gets fresh daemons (hfrt.session.run_flow), K warm-up steps, then N measured steps through the
flow's own step function; reported values are medians over the measured steps. In a step,
StageTimer times each stage-2 call from the stage's start to its reply, so `stage2_max_s` ≈
`stage2_wall_s` when the calls overlap and `stage2_sum_s` is what one-after-another would take
only if overlap cost nothing; the serial reference (`stage2_serial_s`: the same calls awaited one
at a time on a fresh rollout, in the same run) is the honest "no overlap" figure.
With --json the last stdout line is one JSON object: the PPO run's stage2_wall_s, stage2_max_s,
stage2_sum_s, stage2_serial_s, controller_bulk_bytes, tokens_per_s, step_s at the top level, and
every flow's figures under "flows". It knows the flows' step functions and stage-2 endpoints,
nothing of what they compute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine
from hfrt.flows import Flow
from hfrt.flows.agent.grpo import AgentCalcConfig, agent_step, step_function
from hfrt.flows.batches import prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S, FlowConfig
from hfrt.flows.grpo_family import GRPOConfig, train_on
from hfrt.flows.recipes import agent_calc, grpo, grpo_async, ppo
from hfrt.flows.trainer import Trainer, get_roles
from hfrt.log import configure as configure_logging
from hfrt.session import run_flow
from hfrt.wire.loop import run

#: flow name → (default roles, config class, step function)
FLOWS: dict[str, tuple[dict[str, dict[str, Any]], type[FlowConfig], Callable[..., Awaitable[dict[str, Any]]]]] = {
    "ppo": (ppo.ROLES, ppo.Config, ppo.ppo_step),
    "grpo": (grpo.ROLES, grpo.Config, grpo.grpo_step),
    "grpo_async": (grpo_async.ROLES, grpo_async.Config, train_on),
    # the calculator agent flow, synchronous and with --max-staleness (its rollout pipeline)
    "agent_calc": (agent_calc.ROLES, agent_calc.Config, agent_step),
    "agent_calc_async": (agent_calc.ROLES, agent_calc.Config, agent_step),
}


def agent_calc_steps(cfg: AgentCalcConfig, roles: dict[str, Any], trainer: Trainer) -> Any:
    return step_function(cfg, roles, trainer, agent_calc.calc_agent)


#: flows whose step keeps state across steps (a rollout pipeline): factory(cfg, roles, trainer) → step, with close()
STEP_OBJECTS: dict[str, Callable[..., Any]] = {
    "grpo_async": grpo_async.AsyncGRPO, "agent_calc": agent_calc_steps, "agent_calc_async": agent_calc_steps}
#: asynchronous flow → the synchronous one it is compared with (step time ratio); it runs with --max-staleness
ASYNC_OF = {"grpo_async": "grpo", "agent_calc_async": "agent_calc"}
#: stage-2 call name (as StageTimer records it) → (role, endpoint); a flow uses those whose role it has
STAGE2 = {"values": ("critic", "compute_values"), "ref_log_prob": ("reference", "compute_log_prob"), "reward": ("reward", "score")}
#: roles --split places on the generation CPU by default
GEN_ROLES = frozenset({"rollout"})
#: what the bench leaves out of each flow's defaults: no files, no bar, no trace
QUIET = {"run_dir": "", "progress": "off", "tensorboard": False, "trace": False}


def stage2_calls(roles: Mapping[str, Any]) -> list[str]:
    return [name for name, (role, _) in STAGE2.items() if role in roles]


async def serial_stage2(cfg: FlowConfig, roles: Mapping[str, Any], prompts: Any) -> float:
    """One fresh rollout, then its stage-2 calls awaited one at a time: their summed time."""
    n = {"n": cfg.n} if isinstance(cfg, GRPOConfig) else {}
    rollout = await roles["actor"].generate(
        prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, timeout_s=CALL_TIMEOUT_S, **n)
    total = 0.0
    for name in stage2_calls(roles):
        role, endpoint = STAGE2[name]
        start = time.perf_counter()
        await getattr(roles[role], endpoint)(rollout, timeout_s=CALL_TIMEOUT_S)
        total += time.perf_counter() - start
    return total


def pin_split(ctl: Any, roles: Mapping[str, Any], gen_roles: frozenset[str] = GEN_ROLES) -> dict[str, list[int]]:
    """Split pools on one machine: the rollout role's daemons (and those of `gen_roles`) on the
    last CPU, every other daemon on the others (Linux affinity, set from here on the daemons' pids)."""
    cpus = sorted(os.sched_getaffinity(0))
    if "rollout" not in roles or len(cpus) < 2:
        return {}
    placed: dict[str, list[int]] = {}
    for info in ctl.daemons():
        mine = cpus[-1:] if info.role in gen_roles else cpus[:-1]
        os.sched_setaffinity(info.pid, mine)
        placed[info.identity] = mine
    return placed


def bench_flow(
    name: str, steps: int, warmup: int, settings: Mapping[str, Any] | None = None, split: bool = False,
    gen_roles: frozenset[str] = GEN_ROLES,
) -> Flow:
    """A flow that runs `warmup + steps` steps of `name` through its Trainer, keeps the measured
    steps' metrics, then times the serial stage-2 reference `steps` times."""
    roles_spec, config_cls, step_fn = FLOWS[name]

    async def measure(ctl: Any, _config: dict[str, Any]) -> dict[str, Any]:
        cfg = config_cls.read({**QUIET, **(settings or {}), "steps": warmup + steps})
        roles = await get_roles(ctl, *roles_spec)
        placed = pin_split(ctl, roles, gen_roles) if split else {}
        records: list[dict[str, Any]] = []
        trainer = Trainer(ctl, cfg, roles)
        owned = STEP_OBJECTS[name](cfg, roles, trainer) if name in STEP_OBJECTS else None

        async def step(index: int, prompts: Any) -> dict[str, Any]:
            record = await (owned(index, prompts) if owned else step_fn(cfg, index, prompts, **roles))
            records.append(record)
            return record

        try:
            await trainer.run(step)
        except BaseException:
            if owned is not None:
                await owned.close(abort=True)
            raise
        if owned is not None:
            await owned.close()
        serial = [await serial_stage2(cfg, roles, prompts_handle(trainer.source.batch(cfg.prompts_per_step)))
                  for _ in range(steps)]
        return {"records": records[warmup:], "serial": serial, "controller_bulk_bytes": ctl.stats()["controller_bulk_bytes"],
                "pinned": placed}

    return Flow(f"bench-step-{name}", measure, roles_spec)


def summarize(records: list[dict[str, Any]], serial: list[float], calls: list[str], bulk: int) -> dict[str, Any]:
    """Medians over the measured steps (ratios: medians of the per-step ratios); `timings` holds
    every stage's and the actor's own generation timings (rollout/: generate, reshard_to_*)."""
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 4)

    walls = [r["timing/stage2_s"] for r in records]
    maxes = [max(r[f"timing/{c}_s"] for c in calls) for r in records]
    sums = [sum(r[f"timing/{c}_s"] for c in calls) for r in records]
    timings = sorted({k for r in records for k in r if k.startswith(("timing/", "rollout/timing/"))})
    return {
        "steps": len(records), "stage2_calls": calls,
        "stage2_wall_s": med(walls), "stage2_max_s": med(maxes), "stage2_sum_s": med(sums),
        "stage2_serial_s": med(serial),
        "stage2_wall_over_max": med([w / m for w, m in zip(walls, maxes, strict=True)]),
        "stage2_wall_over_sum": med([w / s for w, s in zip(walls, sums, strict=True)]),
        "stage2_wall_over_serial": round(med(walls) / med(serial), 4),
        "controller_bulk_bytes": bulk,
        "tokens_per_s": med([r["perf/tokens_per_s"] for r in records]),
        "response_tokens": med([r.get("response_tokens", 0.0) for r in records]),
        "step_s": med([r["timing/step_s"] for r in records]),
        "timings": {k.replace("timing/", "", 1): med([r[k] for r in records if k in r]) for k in timings},
        "reward_mean": med([r["reward/mean"] for r in records]),
    }


async def bench_raw(
    name: str, steps: int, warmup: int, settings: Mapping[str, Any] | None = None, split: bool = False, heartbeat_s: float = 2.0,
    gen_roles: frozenset[str] = GEN_ROLES,
) -> dict[str, Any]:
    """One run of `name` on fresh daemons: its measured records, serial references, bytes, pinning."""
    with tempfile.TemporaryDirectory(prefix=f"hfrt-bench-step-{name}-") as run_dir:
        return await run_flow(bench_flow(name, steps, warmup, settings, split, gen_roles), run_dir=Path(run_dir), config={},
                              heartbeat_s=heartbeat_s)


async def bench_one(name: str, steps: int, warmup: int, settings: Mapping[str, Any] | None = None, split: bool = False) -> dict[str, Any]:
    return summarize_runs([await bench_raw(name, steps, warmup, settings, split)], settings)


def summarize_runs(runs: list[dict[str, Any]], settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """One flow's figures over the measured steps of every run (rounds) of it."""
    out = {"records": [r for run_ in runs for r in run_["records"]], "serial": [s for run_ in runs for s in run_["serial"]],
           "controller_bulk_bytes": max(int(run_["controller_bulk_bytes"]) for run_ in runs), "pinned": runs[0]["pinned"]}
    calls = [c for c in STAGE2 if f"timing/{c}_s" in out["records"][0]]
    result = summarize(out["records"], out["serial"], calls, int(out["controller_bulk_bytes"]))
    extra = sorted({k for r in out["records"] for k in r if k.startswith(("async/", "sync/", "perf/"))})
    if any(k.startswith("async/") for k in extra):  # an async flow: its staleness, idle times, sync figures
        result["async"] = {k: round(statistics.median([r[k] for r in out["records"] if k in r]), 4) for k in extra}
    result["settings"] = dict(settings or {})
    return result | ({"pinned": out["pinned"]} if out["pinned"] else {})


def table(flows: dict[str, dict[str, Any]]) -> list[str]:
    """The human-readable report: one column per flow."""
    names = list(flows)
    rows: list[tuple[str, str]] = [
        ("step_s", "step time (s)"), ("tokens_per_s", "response tokens / s"),
        ("stage2_wall_s", "stage 2 wall (s)"), ("stage2_max_s", "stage 2 slowest call (s)"),
        ("stage2_sum_s", "stage 2 sum of calls (s)"), ("stage2_serial_s", "stage 2 serial reference (s)"),
        ("stage2_wall_over_max", "wall / slowest  (1 = perfect overlap)"),
        ("stage2_wall_over_sum", "wall / sum"), ("stage2_wall_over_serial", "wall / serial reference"),
        ("controller_bulk_bytes", "controller bulk bytes"),
    ]
    lines = [f"{'':<40}" + "".join(f"{n:>12}" for n in names)]
    lines += [f"{label:<40}" + "".join(f"{flows[n][key]:>12}" for n in names) for key, label in rows]
    stages = sorted({s for n in names for s in flows[n]["timings"]})
    lines += [f"{'  ' + s + ' (s)':<40}" + "".join(f"{flows[n]['timings'].get(s, '-'):>12}" for n in names)
              for s in stages]
    return lines


def setting(item: str, parser: argparse.ArgumentParser) -> tuple[str, Any]:
    """KEY=VALUE from --set, VALUE as JSON when it parses (else the string)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        parser.error(f"--set {item!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="measured steps per flow (medians are over these)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the figures")
    p.add_argument("--flows", default="ppo,grpo", help=f"comma-separated flows to run, from {','.join(FLOWS)}")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the flows this many times, alternating (grpo, grpo_async, grpo, ...); figures are over every round")
    p.add_argument("--gen-roles", default="rollout",
                   help="with --split: the roles placed on the generation CPU (comma-separated; the rollout role always), "
                        "e.g. rollout,reference,reward to take inference off the training CPU")
    p.add_argument("--heartbeat-s", type=float, default=2.0,
                   help="daemon heartbeat interval (a daemon silent for a few intervals is declared gone): raise it on an overloaded machine")
    p.add_argument("--max-staleness", type=int, default=1, help="max_staleness of grpo_async and agent_calc_async (0: synchronous)")
    p.add_argument("--split", action="store_true",
                   help="split pools on this machine: rollout daemons on the last CPU, every other daemon on the rest")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a flow setting for every flow run, e.g. max_new_tokens=16 (VALUE parsed as JSON when it can be; repeatable)")
    add_output_flags(p)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.flows.split(",") if n.strip()]
    unknown = [n for n in names if n not in FLOWS]
    if unknown or not names or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error(f"need --steps >= 1, --warmup >= 0, --rounds >= 1 and --flows from {','.join(FLOWS)} (unknown: {unknown})")
    configure_logging("warning")

    gen_roles = frozenset({"rollout", *(r.strip() for r in args.gen_roles.split(",") if r.strip())})
    common = dict(setting(item, p) for item in args.set)
    settings = {name: common | ({"max_staleness": args.max_staleness} if name in ASYNC_OF else {}) for name in names}
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):  # the flows alternate, so a change in the machine's load hits each alike
        per = {name: run(bench_raw(name, args.steps, args.warmup, settings[name], args.split, args.heartbeat_s, gen_roles))
               for name in names}
        for name in names:
            raw[name].append(per[name])
        rounds.append({"load_avg": [round(x, 2) for x in os.getloadavg()],
                       **{f"{n}_step_s": round(statistics.median(r["timing/step_s"] for r in per[n]["records"]), 4) for n in names}})
    flows = {name: summarize_runs(raw[name], settings[name]) for name in names}
    top = flows.get("ppo", flows[names[0]])
    keys = ("stage2_wall_s", "stage2_max_s", "stage2_sum_s", "stage2_serial_s", "controller_bulk_bytes", "tokens_per_s", "step_s")
    result: dict[str, Any] = {
        **{k: top[k] for k in keys}, "top_level_flow": "ppo" if "ppo" in flows else names[0],
        "steps": args.steps, "warmup": args.warmup, "preset": "tiny", "task": "addition",
        "flows": flows, **machine(), **({"split_gen_roles": sorted(gen_roles)} if args.split else {}),
    }
    for fast, slow in ASYNC_OF.items():  # an async flow's step time against the synchronous one's
        if fast not in flows or slow not in flows:
            continue
        result[f"{fast}_over_{slow}_step_s"] = round(flows[fast]["step_s"] / flows[slow]["step_s"], 4)
        for r in rounds:
            r[f"{fast}_over_{slow}"] = round(r[f"{fast}_step_s"] / r[f"{slow}_step_s"], 4)
        result[f"{fast}_over_{slow}_round_median"] = round(statistics.median(r[f"{fast}_over_{slow}"] for r in rounds), 4)
    if args.rounds > 1:
        result["rounds"] = rounds
    for line in table(flows):
        print(line)
    for fast, slow in ASYNC_OF.items():
        if f"{fast}_over_{slow}_step_s" in result:
            print(f"{fast} step / {slow} step: {result[f'{fast}_over_{slow}_step_s']}")
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
