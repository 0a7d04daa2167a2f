"""Evaluation of the calculator task driven by an agent framework through the OpenAI endpoint (the
`agent_openai` flow's driver, smolagents by default) on held-out questions.

`python -m hfrt.bench.recipes.eval_calc_openai --data runs/calc-task/val.jsonl --model smollm2-135m --model runs/smollm2-calc-openai/hf`
starts a rollout daemon per model (a preset name or an exported Hugging Face folder), serves it on a
loopback OpenAIServer, runs the driver once per row and sample (sampled at `--temperature`, 1 by
default as the recipe trains) and reports per model: accuracy (the reward's mean), the rate of
conversations that ran the calculator, HTTP calls per conversation, and the rate that ended in an
error. `--out FILE` also writes the figures as JSON; `--dump FILE` writes every conversation (its task,
final answer, reward and the token ids of each trajectory the endpoint recorded) as JSON lines, the
input of `sft_calc_openai`'s warm-up data.

It knows the driver/reward contract, the OpenAI server and the rollout role's options; nothing of
training or checkpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hfrt.flows import Flow
from hfrt.flows.agent.external import DRIVERS, DriverCall, Episode, load_callable, run_external
from hfrt.flows.trainer import get_roles
from hfrt.serve.server import OpenAIServer, ServerLimits


def summarize(episodes: Sequence[Episode]) -> dict[str, float]:
    """accuracy, tool_call_rate, calls_mean, error_rate and samples of the episodes."""
    count = len(episodes)
    if not count:
        raise ValueError("no episodes to summarize (an empty data file?)")
    return {
        "samples": count,
        "accuracy": sum(e.reward for e in episodes) / count,
        "tool_call_rate": sum(1 for e in episodes if e.sample.get("tool_calls")) / count,
        "calls_mean": sum(e.calls for e in episodes) / count,
        "error_rate": sum(1 for e in episodes if e.error) / count,
    }


def dump_episodes(episodes: Sequence[Episode], path: Path) -> None:
    """One JSON line per conversation: sample, answer, reward, error and its trajectories' ids."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for e in episodes:
            rows = [{"prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "gen_mask": t.gen_mask} for t in e.trajectories or []]
            out.write(json.dumps({"sample": e.sample, "answer": str(e.answer), "reward": e.reward, "error": e.error,
                                  "trajectories": rows}) + "\n")


def eval_flow(rows: Sequence[dict[str, Any]], args: argparse.Namespace, into: dict[str, Any]) -> Flow:
    """A flow that serves the rollout role and runs the driver `args.samples` times per row."""
    async def run(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        rollout = (await get_roles(ctl, "rollout"))["rollout"]
        driver, reward = load_callable(args.driver, "--driver", DRIVERS), load_callable(args.reward, "--reward")
        samples = [{**r, "uid": str(i)} for i, r in enumerate(rows) for _ in range(args.samples)]
        limits = ServerLimits(max_tokens=args.max_new_tokens, max_prompt_tokens=args.max_total_tokens - args.max_new_tokens,
                              long_request_tokens=10**9)
        key = secrets.token_urlsafe(16)
        async with OpenAIServer(rollout, model="policy", batch_size=args.threads, flush_after_s=0.1, limits=limits, api_key=key,
                                timeout_s=3600.0) as server:  # one round of many conversations may be slow on a busy CPU
            call = DriverCall(base_url=server.url, api_key=key, model="policy", session="", sample={}, max_tokens=args.max_new_tokens,
                              temperature=args.temperature, max_steps=args.max_steps, timeout_s=3600.0,
                              stop=(args.stop,) if args.stop else ())
            start = time.perf_counter()
            episodes = await run_external(server, driver, reward, samples, call, tag="eval-", threads=args.threads)
        into.update(summarize(episodes), generate_s=round(time.perf_counter() - start, 2))
        if args.dump:
            dump_episodes(episodes, Path(args.dump))
        return dict(into)
    return Flow("eval_calc_openai", run, roles={})


def main(argv: list[str] | None = None) -> int:
    from hfrt.bench.recipes.eval_calc import eval_rows, rollout_roles
    from hfrt.session import run_flow

    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.eval_calc_openai", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="runs/calc-task/val.jsonl", help="held-out rows (make_calc_data --style task's val.jsonl)")
    p.add_argument("--model", action="append", required=True, help="a preset name or an exported HF folder; repeat to compare")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N rows (0: all)")
    p.add_argument("--samples", type=int, default=1, help="conversations per row")
    p.add_argument("--temperature", type=float, default=1.0, help="as the recipe trains (1)")
    p.add_argument("--driver", default="smolagents", help="the agent driver (smolagents or module:function)")
    p.add_argument("--reward", default="hfrt.flows.agent.smolagents_calc:calc_reward", help="module:function (answer, sample) -> float")
    p.add_argument("--stop", default="}}", help="a stop string sent with each request (as the recipe's agent_stop)")
    p.add_argument("--max-steps", type=int, default=2, help="the agent's max steps (as the recipe's max_turns)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per HTTP call (as the recipe)")
    p.add_argument("--max-total-tokens", type=int, default=1024, help="prompt + reply of one call (as the recipe)")
    p.add_argument("--threads", type=int, default=32, help="conversations at once")
    p.add_argument("--torch-threads", type=int, default=0, help="torch threads of the rollout daemon (0: its default)")
    p.add_argument("--run-dir", default="runs/eval-calc-openai", help="where daemon logs go (one subfolder per model)")
    p.add_argument("--out", default="", help="also write the figures to this JSON file")
    p.add_argument("--dump", default="", help="also write every conversation (answer, reward, token ids) as JSON lines")
    args = p.parse_args(argv)
    rows = eval_rows(p, args)
    results = []
    for index, model in enumerate(args.model):
        figures: dict[str, Any] = {"model": model}
        roles = rollout_roles(model, threads=args.torch_threads or None)
        asyncio.run(run_flow(eval_flow(rows, args, figures), run_dir=Path(args.run_dir) / f"model{index}", config={"trace": False}, roles=roles))
        results.append(figures)
        print(f"{model}: accuracy {figures['accuracy']:.3f}  calculator used in {figures['tool_call_rate']:.3f}  "
              f"calls {figures['calls_mean']:.2f}  errors {figures['error_rate']:.3f}  on {figures['samples']} "
              f"conversations in {figures['generate_s']:.1f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"data": args.data, "rows": len(rows), "temperature": args.temperature,
                                              "samples_per_row": args.samples, "driver": args.driver, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
