"""The cold-start SFT of the calculator recipe through smolagents: a short supervised warm-up on the
agent's two-call protocol before GRPO, as R1-style recipes (and verl's or OpenRLHF's SFT trainers)
do when a base model never earns a reward.

`python -m hfrt.bench.recipes.sft_calc_openai --dump runs/calc-openai-sft/base-train-dump.jsonl --out runs/calc-openai-sft/hf`

The base SmolLM2-135M-Instruct calls the calculator right and then calls it again on the
observation, so every GRPO group scores 0 and carries no signal. The warm-up data are the exact
prompts the endpoint rendered for the base model on *training* questions (`eval_calc_openai
--dump`): each first call's prompt with the calculator call on the task as target, each second
call's prompt (after "Observation: N") with the `final_answer` call on the right result as target —
the targets in the form the endpoint's tool parser reads, ending at the recipe's stop string `}}`.
The loss is the mean negative log-likelihood of the target tokens (AdamW, a few steps); the model is
saved as a Hugging Face folder the recipe's roles load (`model = "<folder>"`).

It knows the dump's layout and the calculator protocol's two calls; nothing of daemons or GRPO.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from roles.models import load_tokenizer, resolve_model_dir

CALL = '{{"name": "{name}", "arguments": {{"{arg}": "{value}"}}}}'


def examples(dump: Path, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) per first and second call of each dumped conversation; the
    final-answer prompts smolagents sends after max_steps are left out (a trained agent never
    reaches them)."""
    out: list[tuple[list[int], list[int]]] = []
    for line_no, line in enumerate(dump.read_text().splitlines(), 1):
        if not line.strip():
            continue
        conv = json.loads(line)
        task, truth = str(conv["sample"]["prompt"]), str(conv["sample"]["ground_truth"])
        for row in conv["trajectories"]:
            prompt = tokenizer.decode(row["prompt_ids"])
            if "Answer the task from this memory" in prompt:
                continue
            if not prompt.rstrip().endswith("<tool_call>"):
                raise ValueError(f"{dump}:{line_no}: a call's prompt does not end in the opening <tool_call> "
                                 f"(was the dump made with tool_choice required, smolagents' default?): ...{prompt[-80:]!r}")
            last_turn = prompt.rsplit("<|im_start|>user", 1)[-1]
            target = (CALL.format(name="final_answer", arg="answer", value=truth) if "Observation:" in last_turn
                      else CALL.format(name="calculator", arg="expression", value=task))
            out.append((list(row["prompt_ids"]), tokenizer(target, add_special_tokens=False)["input_ids"]))
    if not out:
        raise ValueError(f"{dump}: no conversations with recorded calls")
    return out


def batch(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, attention mask and labels (-100 off the targets), right-padded."""
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, t) in enumerate(rows):
        n = len(p) + len(t)
        ids[i, :n] = torch.tensor(p + t)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(t)
    return ids, mask, labels


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune args.model on the dump's examples; save to args.out; the figures."""
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    if out.exists():
        raise FileExistsError(f"{out} exists: remove it or pick another --out")
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    data = examples(Path(args.dump), tokenizer)
    random.Random(args.seed).shuffle(data)
    data = data[: args.examples] if args.examples else data
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses: list[float] = []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for at in range(0, len(data), args.batch_size):
            ids, mask, labels = batch(data[at: at + args.batch_size], tokenizer.pad_token_id)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))
            print(f"epoch {epoch} step {len(losses)}: loss {losses[-1]:.4f}", flush=True)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # never a half-written model folder
    return {"examples": len(data), "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
            "steps": len(losses), "loss_first": losses[0], "loss_last": losses[-1], "train_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.sft_calc_openai", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", required=True, help="eval_calc_openai --dump of the base model on training questions")
    p.add_argument("--model", default="smollm2-135m", help="the model to warm up (a preset or an HF folder)")
    p.add_argument("--out", required=True, help="the HF folder to write (must not exist)")
    p.add_argument("--examples", type=int, default=32, help="calls trained on (0: all); a light warm-up leaves GRPO room")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default="", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    figures = train(args)
    print(json.dumps(figures), flush=True)
    if args.report:
        Path(args.report).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
