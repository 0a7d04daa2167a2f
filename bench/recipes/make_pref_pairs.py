"""Writes preference pairs for the built-in addition task, labelled by its rule reward, for
docs/reward-models.md: train a reward model on them (`hfrt controller --flow rm`), then run PPO
against it.

`python -m hfrt.bench.recipes.make_pref_pairs --out runs/pairs.jsonl` writes one JSON row a line:

    {"prompt": "1+2=", "chosen": "3</s>", "rejected": "7</s>"}

Responses are drawn in the form the `ppo` flow's actor produces (at most max_new_tokens = 2
tokens of the tiny preset's byte tokenizer; "</s>", its EOS, where generation stopped), so the
reward model sees at training what it scores in PPO (train it with `append_eos = false`). The
chosen response is the one the rule (hfrt.flows.tasks.addition_reward) scores higher; with
--margin a row also holds `margin`, the rule-score difference. The pairs are
hfrt.flows.pairs.addition_pairs, what the `rm` flow trains on when it is given no data file.
It knows the pair-file format; nothing of training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hfrt.flows.pairs import addition_pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=2, help="as the ppo flow's max_operand")
    parser.add_argument("--margin", action="store_true", help="add the rule-score difference as `margin`")
    args = parser.parse_args(argv)
    rows = addition_pairs(args.count, args.seed, args.max_operand, args.margin)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"out": args.out, "pairs": len(rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
