"""Evaluation (greedy or sampled) of the calculator-tool agent (the `agent_calc` flow's `calc_agent`) on held-out prompts.

`python -m hfrt.bench.recipes.eval_calc --data runs/calc/val.jsonl --model smollm2-135m --model runs/smollm2-calc/hf`
starts a rollout daemon per model (a preset name or an exported Hugging Face folder), runs the agent
loop on every row — greedily by default; `--temperature 1 --samples 4` samples as training does,
four times a row, from a fixed seed — and reports per model: accuracy (reward mean), the rate of
samples that called the tool, the mean number of calls, and the rate of samples that ended in an
error (a limit or a bad expression). `--out FILE` also writes the figures as JSON.

It knows the agent loop and the rollout role's options; nothing of training or checkpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hfrt.flows import Flow
from hfrt.flows.agent.loop import AgentConfig, Trajectory, run_agents
from hfrt.flows.data import DatasetError, read_rows
from hfrt.flows.recipes.agent_calc import calc_agent
from hfrt.flows.trainer import get_roles


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """accuracy, tool_call_rate, tool_calls_mean, error_rate, turns_mean and samples of finished conversations."""
    count = len(trajectories)
    if not count:
        raise ValueError("no trajectories to summarize (an empty data file?)")
    calls = [int(t.sample.get("tool_calls") or 0) for t in trajectories]
    return {
        "samples": count,
        "accuracy": sum(t.reward for t in trajectories) / count,
        "tool_call_rate": sum(1 for c in calls if c > 0) / count,
        "tool_calls_mean": sum(calls) / count,
        "error_rate": sum(1 for t in trajectories if t.error) / count,
        "turns_mean": sum(t.turns for t in trajectories) / count,
    }


def rollout_roles(model: str, *, dtype: str = "float32", threads: int | None = None) -> dict[str, dict[str, Any]]:
    """The one role an evaluation needs: a rollout daemon holding `model`."""
    options: dict[str, Any] = {"model": model, "dtype": dtype, "sampling": {"top_k": 0}}
    if threads:
        options["threads"] = threads
    return {"rollout": {"impl": "rollout", "options": options}}


def eval_flow(rows: Sequence[dict[str, Any]], agent_cfg: AgentConfig, into: dict[str, Any], samples_per_row: int = 1) -> Flow:
    """A flow that runs the agent `samples_per_row` times per row on the rollout role and puts the summary in `into`."""
    async def run(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        rollout = (await get_roles(ctl, "rollout"))["rollout"]
        samples = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows for _ in range(samples_per_row)]
        start = time.perf_counter()
        trajectories = await run_agents(rollout, calc_agent, samples, agent_cfg)
        into.update(summarize(trajectories), generate_s=round(time.perf_counter() - start, 2))
        return dict(into)
    return Flow("eval_calc", run, roles={})


async def evaluate(model: str, rows: Sequence[dict[str, Any]], agent_cfg: AgentConfig, run_dir: Path, *,
                   samples_per_row: int = 1, **role_kw: Any) -> dict[str, Any]:
    """The summary of agent runs of `model` on `rows` (daemon logs under run_dir/logs)."""
    from hfrt.session import run_flow

    figures: dict[str, Any] = {"model": model}
    await run_flow(eval_flow(rows, agent_cfg, figures, samples_per_row), run_dir=run_dir, config={"trace": False}, roles=rollout_roles(model, **role_kw))
    return figures


def eval_rows(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The held-out rows of --data (the first --limit), after checking every --model folder;
    p.error naming the flag otherwise. Shared by the eval scripts of the calculator recipes."""
    try:
        rows = read_rows(args.data)
    except DatasetError as exc:
        p.error(f"--data: {exc}")
    rows = rows[: args.limit] if args.limit else rows
    if not rows:
        p.error(f"--data {args.data}: no rows")
    missing = [m for m in args.model if "/" in m and not (Path(m) / "config.json").is_file()]
    if missing:
        p.error(f"--model {missing[0]}: no config.json there (export a run with export_hf=true: RUN_DIR/hf)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.eval_calc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="runs/calc/val.jsonl", help="held-out rows (make_calc_data's val.jsonl)")
    p.add_argument("--model", action="append", required=True,
                   help="a preset name or an exported HF folder (RUN_DIR/hf); repeat to compare models")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N rows (0: all)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); 1: as the recipe trains")
    p.add_argument("--samples", type=int, default=1, help="conversations per row (use more than 1 only when sampling)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every model)")
    p.add_argument("--max-new-tokens", type=int, default=12, help="per turn (as the recipe)")
    p.add_argument("--max-total-tokens", type=int, default=160, help="per conversation (as the recipe)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the rollout daemon (0: its default)")
    p.add_argument("--run-dir", default="runs/eval-calc", help="where daemon logs go (one subfolder per model)")
    p.add_argument("--out", default="", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    rows = eval_rows(p, args)
    if args.samples < 1 or args.temperature < 0:
        p.error(f"--samples {args.samples} --temperature {args.temperature}: need at least 1 sample and a temperature >= 0")
    agent_cfg = AgentConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, max_total_tokens=args.max_total_tokens,
                            max_turns=6, sample_timeout_s=600.0, seed=args.seed)
    results = []
    for index, model in enumerate(args.model):
        figures = asyncio.run(evaluate(model, rows, agent_cfg, Path(args.run_dir) / f"model{index}",
                                       samples_per_row=args.samples, threads=args.threads or None))
        results.append(figures)
        print(f"{model}: accuracy {figures['accuracy']:.3f}  tool calls {figures['tool_call_rate']:.3f} of samples "
              f"({figures['tool_calls_mean']:.2f} each)  errors {figures['error_rate']:.3f}  "
              f"on {figures['samples']} samples in {figures['generate_s']:.1f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"data": args.data, "rows": len(rows), "temperature": args.temperature,
                                              "samples_per_row": args.samples, "seed": args.seed, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
