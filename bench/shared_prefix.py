"""Shared-prefix benchmark: on a long-prompt GRPO shape (prompts of --prompt-tokens, --n samples
each, --new-tokens response tokens), the median time of the reference pass (a log-prob forward)
and of the update (one optimizer step: forward, backward, AdamW) with engine.shared_prefix on and
off, interleaved in one run, their ratios (of wall time, and of the process's CPU time, which
other work on a shared machine disturbs less), the tokens each computed, and the largest log-prob and
gradient difference between the two (exactness on the benchmark's own rows).

Run: `python -m hfrt.bench.shared_prefix [--model tiny|smollm2-135m ...] [--prompt-tokens 256]
[--n 8] [--new-tokens 32] [--prompts 2] [--micro-batch-size 16] [--reps 3] [--json] [--out FILE]`.
One process, the CPU (or the first GPU), fp32, the local engine. `--check FILE` re-measures and
exits 1 when a speedup falls below the floors FILE's `documented` table gives (the docs' figures).
It knows nothing of RL beyond one PPO loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine

PASSES = ("reference", "update")


def grouped_batch(
    vocab: int, prompts: int, n: int, prompt_tokens: int, new_tokens: int, seed: int = 0
) -> dict[str, Any]:
    """`prompts` random prompts of prompt_tokens tokens, each repeated n times, with random
    responses of new_tokens // 2 .. new_tokens tokens (right-padded) and PPO columns."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = prompts * n
    prompt = torch.randint(3, vocab, (prompts, prompt_tokens), generator=g).repeat_interleave(n, 0)
    lengths = torch.randint(new_tokens // 2, new_tokens + 1, (rows,), generator=g)
    mask = (torch.arange(new_tokens)[None] < lengths[:, None]).long()
    response = torch.randint(3, vocab, (rows, new_tokens), generator=g) * mask
    return {
        "input_ids": torch.cat([prompt, response], 1),
        "attention_mask": torch.cat([torch.ones_like(prompt), mask], 1),
        "responses": response, "response_mask": mask,
        "advantages": torch.randn(rows, new_tokens, generator=g), "old_log_probs": torch.full((rows, new_tokens), -6.0),
    }  # fmt: skip


def measure_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both ways on one model: medians, ratios, tokens, and the largest differences."""
    import torch

    from hfrt.roles.losses import PolicyLossConfig, policy_loss
    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    model = load_model(ModelConfig(name, "float32"))
    batch = grouped_batch(model.config.vocab_size, args.prompts, args.n, args.prompt_tokens, args.new_tokens)
    loss_config = PolicyLossConfig(agg_mode="token-mean")

    def loss_fn(out: Any, mb: Any, scale: Any) -> Any:
        return policy_loss(
            out.log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"], loss_config, scale
        )

    engines = {
        shared: build_train_engine(model, EngineConfig(optim=OptimConfig(lr=0.0), micro_batch_size=args.micro_batch_size,
                                                       shared_prefix=shared))
        for shared in (False, True)
    }  # fmt: skip
    times: dict[bool, dict[str, list[float]]] = {s: {p: [] for p in PASSES} for s in engines}
    cpu: dict[bool, dict[str, list[float]]] = {s: {p: [] for p in PASSES} for s in engines}
    outputs: dict[bool, Any] = {}
    for _ in range(args.reps):  # interleaved: both ways see the same machine load
        for shared, engine in engines.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            log_probs = engine.forward_logprobs(batch)
            times[shared]["reference"].append(time.perf_counter() - start)
            cpu[shared]["reference"].append(time.process_time() - start_cpu)
            start, start_cpu = time.perf_counter(), time.process_time()
            metrics = engine.step(loss_fn, batch)
            metrics |= dict(zip(("tokens_computed", "tokens_in_batch"), engine.sharing.tokens, strict=True))
            times[shared]["update"].append(time.perf_counter() - start)
            cpu[shared]["update"].append(time.process_time() - start_cpu)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            outputs[shared] = (log_probs, grads, metrics)
    mask = batch["response_mask"].bool()
    (lp, grads, metrics), (slp, sgrads, smetrics) = outputs[False], outputs[True]
    out: dict[str, Any] = {
        "tokens_in_batch": smetrics["tokens_in_batch"],
        "tokens_computed": {"unshared": metrics["tokens_computed"], "shared": smetrics["tokens_computed"]},
        "max_log_prob_diff": float((lp - slp)[mask].abs().max()),
        "max_grad_diff": max(float((grads[k] - sgrads[k]).abs().max()) for k in grads),
        "loss_diff": abs(metrics["loss"] - smetrics["loss"]),
    }
    for p in PASSES:
        unshared_s, shared_s = statistics.median(times[False][p]), statistics.median(times[True][p])
        unshared_cpu, shared_cpu = statistics.median(cpu[False][p]), statistics.median(cpu[True][p])
        out[p] = {"unshared_median_s": round(unshared_s, 4), "shared_median_s": round(shared_s, 4),
                  "speedup": round(unshared_s / shared_s, 3),
                  "unshared_cpu_median_s": round(unshared_cpu, 4), "shared_cpu_median_s": round(shared_cpu, 4),
                  "cpu_speedup": round(unshared_cpu / shared_cpu, 3),
                  "unshared_s": [round(t, 4) for t in times[False][p]], "shared_s": [round(t, 4) for t in times[True][p]]}  # fmt: skip
    del torch
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    models = {name: measure_model(name, args) for name in args.model}
    return {
        "bench": "shared-prefix", **machine(), "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(), "dtype": "float32", "engine": "local",
        "shape": {"prompts": args.prompts, "n": args.n, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                  "micro_batch_size": args.micro_batch_size},
        "reps": args.reps, "models": models,
    }  # fmt: skip


def check(result: dict[str, Any], documented: dict[str, Any]) -> list[str]:
    """Each documented floor {model: {pass: speedup}} of a model the result measured that it falls below, as a line."""
    misses = []
    for name, floors in documented.items():
        if name not in result["models"]:  # e.g. --model tiny: a part of the documented run
            continue
        for p, floor in floors.items():
            got = result["models"][name].get(p, {}).get("speedup")
            if got is None or got < floor:
                misses.append(f"{name} {p}: speedup {got} below the documented floor {floor}")
    return misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfrt.bench.shared_prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["tiny", "smollm2-135m"], help="presets or model folders")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="response width (rows have half to all of it)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--check", help="a results JSON whose `documented` floors the new run must reach")
    add_output_flags(parser)
    args = parser.parse_args(argv)
    result = measure(args)
    for name, r in result["models"].items():
        for p in PASSES:
            print(f"{name:14s} {p:9s} unshared {r[p]['unshared_median_s']:.3f} s  shared {r[p]['shared_median_s']:.3f} s  "
                  f"speedup {r[p]['speedup']:.2f}x (CPU time {r[p]['cpu_speedup']:.2f}x)")  # fmt: skip
        print(f"{name:14s} tokens computed {r['tokens_computed']['unshared']:.0f} -> {r['tokens_computed']['shared']:.0f} "
              f"of {r['tokens_in_batch']:.0f} in the batch; max |log-prob diff| {r['max_log_prob_diff']:.2e}, "
              f"max |grad diff| {r['max_grad_diff']:.2e}")  # fmt: skip
    if args.check:
        with open(args.check) as f:
            misses = check(result, json.load(f)["documented"])
        for line in misses:
            print("MISS", line)
        emit(result, args)
        return 1 if misses else 0
    emit(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
