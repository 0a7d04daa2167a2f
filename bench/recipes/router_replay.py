"""Routing replay on the tiny-moe preset: how far the trainer's MoE routing drifts from the
rollout's, and what replaying it costs, with `router_replay` off (record and measure) and on.

`python -m hfrt.bench.recipes.router_replay --out bench/results/router-replay-DATE.json [--steps 6]`

Runs, each `hfrt controller` as a user runs it (GRPO's 16 prompts x 8 samples, the addition task):
- grpo fp32: the option absent (the reference time), false, true;
- grpo with the actor at bf16 mixed precision (the rollout's HF engine stays fp32): false, true;
- grpo_async with max_staleness=1 (the rollout role samples with weights one update old): false, true.
Per run, the medians over steps 1.. (step 0 warms up) of router_mismatch/share, the log-prob gap
(router_mismatch/log_prob_abs_diff, k3_kl), timing/update_s, timing/generate_s and timing/step_s.
`check` holds the figures docs/moe-routing-replay.md states: replay on gives share 0 (the experts
used are the rollout's) on every step of every run while own_share (the trainer's own top-k) stays
above 0 where it was off; off, the stale rollout's median share is above 0.05 and bf16's largest
above 0. `cost` (in this process, interleaved) times one update step and one log-prob pass of a
larger random Qwen3-MoE with the option absent, off and on.
Exit 1 when one fails. It reads metrics files; nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hfrt.bench.common import machine
from hfrt.bench.recipes.rm_recipe import controller

QUIET = ("--set", "tensorboard=false", "--set", "trace=false", "--set", "export_hf=false", "--overwrite")
MODEL = "tiny-moe"
#: (name, flow, extra --set items, router_replay or None for absent)
RUNS: list[tuple[str, str, tuple[str, ...], bool | None]] = [
    ("fp32_absent", "grpo", (), None),
    ("fp32_off", "grpo", (), False),
    ("fp32_on", "grpo", (), True),
    ("bf16_off", "grpo", ("roles.actor.options.engine.mixed_precision=bf16",), False),
    ("bf16_on", "grpo", ("roles.actor.options.engine.mixed_precision=bf16",), True),
    ("stale_off", "grpo_async", ("max_staleness=1",), False),
    ("stale_on", "grpo_async", ("max_staleness=1",), True),
]
KEYS = ("router_mismatch/share", "router_mismatch/own_share", "router_mismatch/log_prob_abs_diff", "router_mismatch/k3_kl",
        "timing/update_s", "timing/generate_s", "timing/step_s", "response_length/mean")


def sets(flow: str, extra: tuple[str, ...], replay: bool | None, steps: int, seed: int) -> list[str]:
    roles = ["actor", "reference"] + (["rollout"] if flow == "grpo_async" else [])
    items = [f"steps={steps}", f"seed={seed}", *extra] + [f"roles.{r}.options.model={MODEL}" for r in roles]
    if replay is not None:
        items += [f"roles.{r}.options.router_replay={str(replay).lower()}" for r in roles if r != "reference"]
    return [a for item in items for a in ("--set", item)]


def one(work: Path, name: str, flow: str, extra: tuple[str, ...], replay: bool | None, steps: int, seed: int,
        reuse: bool = False) -> dict[str, Any]:
    run_dir = work / name
    metrics = run_dir / "metrics.jsonl"
    if reuse and metrics.exists() and len(metrics.read_text().splitlines()) == steps:
        summary = {"wall_s": None}  # read back from an earlier run of this script
    else:
        summary = controller("--flow", flow, "--run-dir", str(run_dir), *sets(flow, extra, replay, steps, seed), *QUIET)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    later = records[1:] or records
    out: dict[str, Any] = {"flow": flow, "router_replay": replay, "sets": list(extra), "wall_s": summary["wall_s"]}
    for key in KEYS:
        values = [float(r[key]) for r in later if key in r]
        if values:
            out[key] = {"median": statistics.median(values), "max": max(values), "per_step": [round(v, 6) for v in values]}
    return out


def routing_bytes(model: str = MODEL) -> dict[str, Any]:
    """The recorded column's size: bytes per token (MoE layers x k x the id's bytes) and per row of
    the default shape, from the model's config."""
    import torch

    from hfrt.roles.models import resolve_model_dir
    from hfrt.roles.training.router_replay import column_dtype

    config = json.loads((resolve_model_dir(model) / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]  # transformers writes either
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    per_id = torch.empty((), dtype=column_dtype(experts)).element_size()
    return {"moe_layers": layers, "k": k, "experts": experts, "bytes_per_token": layers * k * per_id,
            "qwen3_30b_a3b_bytes_per_token": 48 * 8 * 1}


#: the cost model: a random Qwen3-MoE of 4 layers, hidden 128, 8 experts, 2 per token; 8 rows of 24 + 24 tokens
COST_SHAPE = {"layers": 4, "hidden": 128, "experts": 8, "k": 2, "rows": 8, "prompt": 24, "response": 24}


def cost(rounds: int = 7) -> dict[str, Any]:
    """Median seconds of one update step (forward + backward + AdamW) and one log-prob pass on the
    local engine with the option absent (no hooks), off (hooks measure) and on (hooks replay),
    interleaved round by round, replaying the model's own routing (recorded once, so every mode
    runs the same experts and the difference is the hooks'); the recorded column's bytes for the
    batch beside input_ids'."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from hfrt.roles.generation.routing_record import Recorder
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
    from hfrt.roles.training.router_replay import ROUTED_EXPERTS, RouterReplay

    c = COST_SHAPE
    torch.set_num_threads(1)  # one core: less exposed to other work on a shared machine
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: not in the stubs
        vocab_size=512, hidden_size=c["hidden"], intermediate_size=512, num_hidden_layers=c["layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=c["experts"],
        num_experts_per_tok=c["k"], moe_intermediate_size=128, mlp_only_layers=[])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    engine = build_train_engine(model, EngineConfig(micro_batch_size=c["rows"], optim=OptimConfig(lr=0.0)))  # weights stay
    width = c["prompt"] + c["response"]
    ids = torch.randint(3, 512, (c["rows"], width))
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "responses": ids[:, c["prompt"]:], "response_mask": ones[:, c["prompt"]:]}
    recorder = Recorder(model)
    with recorder.recording(), torch.no_grad():
        model(input_ids=ids, attention_mask=ones)
    routed = recorder.routed(c["rows"], ones)

    def loss(out: Any, mb: Any, _scale: Any) -> tuple[Any, dict[str, float]]:
        return -(out.log_probs * mb["response_mask"]).mean(), {}

    times: dict[str, dict[str, list[float]]] = {m: {"update_s": [], "log_prob_s": []} for m in ("absent", "off", "on")}
    for _ in range(rounds):
        for mode in ("absent", "off", "on"):
            hooks = None if mode == "absent" else RouterReplay(model, replay=mode == "on")
            data = batch if hooks is None else batch | {ROUTED_EXPERTS: routed}
            start = time.perf_counter()
            engine.step(loss, data)
            middle = time.perf_counter()
            engine.forward(data)
            times[mode]["update_s"].append(middle - start)
            times[mode]["log_prob_s"].append(time.perf_counter() - middle)
            if hooks is not None:
                hooks.remove()
    medians = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    ratios = {m: {k: round(medians[m][k] / medians["absent"][k], 3) for k in medians[m]} for m in ("off", "on")}
    return {"shape": c, "rounds": rounds, "median_s": medians, "vs_absent": ratios,
            "column_bytes": routed.numel() * routed.element_size(), "input_ids_bytes": ids.numel() * ids.element_size()}


#: the documented bound on replay's update-step time against the option absent (cost())
COST_BOUND = 1.5


def check(runs: dict[str, Any], costs: dict[str, Any] | None = None) -> list[str]:
    """The documented figures that do not hold (empty: all hold)."""
    failed = []
    if costs is not None and costs["vs_absent"]["on"]["update_s"] > COST_BOUND:
        failed.append(f"cost: an update step with replay took {costs['vs_absent']['on']['update_s']}x the time without "
                      f"(documented: under {COST_BOUND}x)")
    for name, run in runs.items():
        share = run.get("router_mismatch/share")
        if run["router_replay"] is not None and share is None:
            failed.append(f"{name}: no router_mismatch/share metric")
        if run["router_replay"] is True and share is not None and share["max"] != 0.0:
            failed.append(f"{name}: replay on, mismatch share {share['max']} (expected 0 on every step)")
    for name in ("bf16_on", "stale_on"):  # replay had something to override
        own = runs.get(name, {}).get("router_mismatch/own_share")
        if own is not None and own["max"] <= 0.0:
            failed.append(f"{name}: the trainer's own top-k never differed (replay overrode nothing)")
    stale = runs.get("stale_off", {}).get("router_mismatch/share")
    if stale is not None and stale["median"] <= 0.05:
        failed.append(f"stale_off: median mismatch share {stale['median']} (expected above 0.05)")
    bf16 = runs.get("bf16_off", {}).get("router_mismatch/share")
    if bf16 is not None and bf16["max"] <= 0.0:
        failed.append("bf16_off: no step had a mismatch (expected some)")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--work", default="runs/router-replay", help="the runs' folders go here")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (medians over steps 1..)")
    parser.add_argument("--seed", type=int, default=0, help="every run's seed")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--cost-rounds", type=int, default=15, help="interleaved rounds of the in-process cost timing")
    parser.add_argument("--reuse", action="store_true", help="read runs already in --work (same steps) instead of running them")
    args = parser.parse_args(argv)
    started = time.time()
    wanted = set(filter(None, args.only.split(",")))
    runs = {name: one(Path(args.work), name, flow, extra, replay, args.steps, args.seed, args.reuse)
            for name, flow, extra, replay in RUNS if not wanted or name in wanted}
    base = runs.get("fp32_absent", {}).get("timing/update_s", {}).get("median")
    ratios = {name: round(r["timing/update_s"]["median"] / base, 3) for name, r in runs.items()
              if base and r["flow"] == "grpo" and "bf16" not in name and "timing/update_s" in r}
    costs = cost(args.cost_rounds)
    failed = check(runs, costs)
    result = {"machine": machine(), "model": MODEL, "steps": args.steps, "column": routing_bytes(), "runs": runs,
              "update_time_vs_absent": ratios, "cost": costs, "failed": failed, "bench_wall_s": round(time.time() - started, 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
