"""Token-budget benchmark: on one varied-length batch (prompts and responses of very different
lengths, seeded), the padding fraction, the median time of a training step and of a log-prob
forward, and the most activation bytes autograd holds for backward at once, for four ways of cutting it into micro-batches — `padded` (micro_batch_size rows, each at
the batch's full width: hfrt before token budgets), `trimmed` (the same rows, each micro-batch cut to
its own longest prompt and response: the default now), `budget` (max_tokens_per_micro_batch,
trimmed) and `packed` (the budget, pack = true) — interleaved in one run, ratios against `padded`.

Run: `hfrt bench token-budget [--rows 32] [--max-new-tokens 512] [--budget 4096]
[--micro-batch-size 4] [--hidden 128] [--layers 4] [--reps 3] [--json] [--out FILE]`. One process,
the CPU (or the first GPU), a random Llama-shaped model built in code, fp32. It knows nothing of
RL beyond one PPO loss.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine

WAYS = ("padded", "trimmed", "budget", "packed")


def varied_lengths(rows: int, max_new_tokens: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompts uniform in [16, 96] tokens; responses log-normal (median max_new_tokens / 8), in [1, max_new_tokens]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, 97, (rows,), generator=g)
    responses = (torch.randn(rows, generator=g) * 1.0).exp() * (max_new_tokens / 8)
    return prompts.tolist(), responses.round().clamp(1, max_new_tokens).long().tolist()


def make_batch(prompts: list[int], responses: list[int], vocab: int, max_new_tokens: int) -> dict[str, Any]:
    """engines/base.py's layout: prompts left-padded to the longest, responses right-padded to max_new_tokens."""
    import torch

    width, rows = max(prompts), len(prompts)
    p, r = torch.tensor(prompts), torch.tensor(responses)
    mask = torch.cat([torch.arange(width)[None] >= width - p[:, None], torch.arange(max_new_tokens)[None] < r[:, None]], 1).long()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, width + max_new_tokens), generator=g) * mask
    return {
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, width:], "response_mask": mask[:, width:],
        "advantages": torch.randn(rows, max_new_tokens, generator=g), "old_log_probs": torch.full((rows, max_new_tokens), -6.0),
    }  # fmt: skip


def padded_micro_batches(batch: dict[str, Any], size: int) -> list[Any]:
    """hfrt's micro-batches before token budgets: `size` rows at the batch's full width."""
    import torch

    from hfrt.roles.training import batching

    rows, width = int(batch["input_ids"].shape[0]), int(batch["responses"].shape[1])
    names = ("input_ids", "attention_mask", "position_ids", "responses")
    out = []
    for start in range(0, rows, size):
        index = torch.arange(start, min(start + size, rows))
        out.append(batching.Micro(index, {n: batch[n][index] for n in names}, width))
    return out


def saved_for_backward(run: Any) -> int:
    """The most bytes of tensors autograd held for backward at once while `run()` ran (counted
    through saved-tensor hooks; the weights a layer saves count too, the same for every way)."""
    import torch

    held = [0, 0]

    class Saved:
        def __init__(self, t: Any) -> None:
            self.t, self.n = t, t.numel() * t.element_size()
            held[0] += self.n
            held[1] = max(held[1], held[0])

        def __del__(self) -> None:
            held[0] -= self.n

    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.t):
        run()
    return held[1]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hfrt.roles.losses import PolicyLossConfig, policy_loss
    from hfrt.roles.training import batching
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).float()
    prompts, responses = varied_lengths(args.rows, args.max_new_tokens)
    batch = make_batch(prompts, responses, config.vocab_size, args.max_new_tokens)
    lengths = batching.row_lengths(batch)
    loss_config = PolicyLossConfig(agg_mode="token-mean")

    def loss_fn(out: Any, mb: Any, scale: Any) -> Any:
        return policy_loss(out.log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"], loss_config, scale)

    settings = {
        "padded": {"micro_batch_size": args.micro_batch_size},
        "trimmed": {"micro_batch_size": args.micro_batch_size},
        "budget": {"max_tokens_per_micro_batch": args.budget},
        "packed": {"max_tokens_per_micro_batch": args.budget, "pack": True},
    }
    engines = {way: build_train_engine(model, EngineConfig(optim=OptimConfig(lr=0.0), **s)) for way, s in settings.items()}
    engines["padded"].micro_batches = lambda b, size=None: padded_micro_batches(b, args.micro_batch_size)  # type: ignore[method-assign]
    real = sum(lengths.total(i) for i in range(args.rows))
    result: dict[str, Any] = {}
    for way, engine in engines.items():
        micros = engine.micro_batches(batch)
        slots = sum(int(m.inputs["input_ids"].numel()) for m in micros)
        result[way] = {"micro_batches": len(micros), "token_slots": slots, "padding_fraction": round(1 - real / slots, 4),
                       "step_s": [], "forward_s": []}  # fmt: skip
    for _ in range(args.reps):  # interleaved: every way sees the same machine load
        for way, engine in engines.items():
            start = time.perf_counter()
            engine.step(loss_fn, batch)
            result[way]["step_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.forward_logprobs(batch)
            result[way]["forward_s"].append(time.perf_counter() - start)
    for way, engine in engines.items():  # one more step, untimed, counting what autograd holds
        result[way]["activations_held_mb"] = round(saved_for_backward(functools.partial(engine.step, loss_fn, batch)) / 2**20, 2)
    for way in WAYS:
        for key in ("step_s", "forward_s"):
            result[way][key.replace("_s", "_median_s")] = round(statistics.median(result[way].pop(key)), 4)
        for key in ("step", "forward"):
            result[way][f"{key}_vs_padded"] = round(result[way][f"{key}_median_s"] / result["padded"][f"{key}_median_s"], 3)
    return {
        "bench": "token-budget", **machine(), "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "model": {"hidden": args.hidden, "layers": args.layers, "dtype": "float32"},
        "batch": {"rows": args.rows, "max_new_tokens": args.max_new_tokens, "real_tokens": real,
                  "full_width": int(batch["input_ids"].shape[1]), "prompt_lengths": prompts, "response_lengths": responses},
        "budget": args.budget, "micro_batch_size": args.micro_batch_size, "reps": args.reps, "ways": result,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hfrt bench token-budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--budget", type=int, default=4096, help="max_tokens_per_micro_batch of the budget / packed ways")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch of the padded / trimmed ways")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    add_output_flags(parser)
    args = parser.parse_args(argv)
    result = measure(args)
    for way in WAYS:
        r = result["ways"][way]
        print(f"{way:8s} micro-batches {r['micro_batches']:3d}  padding {r['padding_fraction']:.1%}  "
              f"step {r['step_median_s']:.3f} s ({r['step_vs_padded']:.2f}x)  forward {r['forward_median_s']:.3f} s ({r['forward_vs_padded']:.2f}x)  "
              f"held for backward {r['activations_held_mb']:.1f} MiB")  # fmt: skip
    emit(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
