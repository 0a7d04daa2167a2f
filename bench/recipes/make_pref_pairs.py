"""Writes preference pairs for the built-in addition task, labelled by its rule reward, for
docs/reward-models.md: train a reward model on them (`hfrt controller --flow rm`), then run PPO
against it.

`python -m hfrt.bench.recipes.make_pref_pairs --out runs/pairs.jsonl` writes one JSON row a line:

    {"prompt": "1+2=", "chosen": "3</s>", "rejected": "7</s>"}

Responses are drawn in the form the `ppo` flow's actor produces (at most max_new_tokens = 2
tokens of the tiny preset's byte tokenizer; "</s>", its EOS, where generation stopped), so the
reward model sees at training what it scores in PPO (train it with `append_eos = false`). The
chosen response is the one the rule (hfrt.flows.tasks.addition_reward) scores higher; With
--margin a row also holds `margin`, the rule-score difference. It knows the task and the pair-file format;
nothing of training.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Any

from hfrt.flows.tasks import AdditionTask, addition_reward

EOS = "</s>"
OTHER = string.ascii_letters + string.punctuation + " "


def response(rng: random.Random, truth: str) -> str:
    """One response in the actor's form: a digit (often the right one) and EOS, two characters
    (no EOS: cut at max_new_tokens), a non-digit and EOS, or EOS alone."""
    digit = truth if rng.random() < 0.35 else str(rng.randint(0, 9))
    form = rng.random()
    if form < 0.45:
        return digit + EOS
    if form < 0.75:
        return digit + rng.choice(string.digits + " =\n" + OTHER[:10])
    if form < 0.9:
        return rng.choice(OTHER) + rng.choice([EOS, rng.choice(string.digits)])
    return EOS


def pairs(count: int, seed: int, max_operand: int, margin: bool = False) -> list[dict[str, Any]]:
    """`count` pairs: a prompt from the task, two responses the rule scores differently (with
    `margin`, the rule-score difference as the pair's margin)."""
    rng = random.Random(seed)
    task = AdditionTask(seed=seed, max_operand=max_operand)
    out: list[dict[str, Any]] = []
    while len(out) < count:
        prompts = task.batch(1)
        prompt, truth = prompts["prompt"][0], prompts["ground_truth"][0]
        a, b = response(rng, truth), response(rng, truth)
        score_a, score_b = (addition_reward(r.replace(EOS, ""), truth) for r in (a, b))
        if score_a == score_b:
            continue
        chosen, rejected = (a, b) if score_a > score_b else (b, a)
        row: dict[str, Any] = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        out.append(row | ({"margin": round(abs(score_a - score_b), 3)} if margin else {}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=2, help="as the ppo flow's max_operand")
    parser.add_argument("--margin", action="store_true", help="add the rule-score difference as `margin`")
    args = parser.parse_args(argv)
    rows = pairs(args.count, args.seed, args.max_operand, args.margin)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"out": args.out, "pairs": len(rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
