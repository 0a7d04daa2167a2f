"""Writes the calculator-tool recipe's data: few-shot addition prompts that show the `<calc>` tool.

`python -m hfrt.bench.recipes.make_calc_data --out runs/calc` writes train.jsonl and val.jsonl, disjoint,
from a seed. A row is a plain-text prompt (no chat template) holding two worked examples of the
tool syntax the `agent_calc` flow runs, then the question:

    {"prompt": "Use the calculator.\\n23+45=<calc>23+45</calc>[68]68\\n71+18=<calc>71+18</calc>[89]89\\n59+63=",
     "ground_truth": "122", "data_source": "calc"}

With `--style task` a row's prompt is the bare question (`59+63`) instead: the task an agent
framework is given (the `agent_openai` flow, whose smolagents driver shows the tool in its own
system prompt); the same seed asks the same questions in either style.

It knows the row format of hfrt's data files and the flow's tool syntax; nothing of training.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

#: the worked examples every prompt starts with (never asked as questions)
EXAMPLES = ((23, 45), (71, 18))
HEADER = "Use the calculator.\n" + "".join(f"{a}+{b}=<calc>{a}+{b}</calc>[{a + b}]{a + b}\n" for a, b in EXAMPLES)


def prompt(a: int, b: int) -> str:
    """The few-shot prompt asking for a + b (the policy continues after '=')."""
    return f"{HEADER}{a}+{b}="


#: a row's prompt per --style: the few-shot text agent_calc continues, or the bare task for an agent framework
STYLES = {"few-shot": prompt, "task": lambda a, b: f"{a}+{b}"}


def rows(count: int, seed: int, low: int, high: int, skip: set[tuple[int, int]], style: str = "few-shot") -> list[dict[str, object]]:
    """`count` distinct questions a+b (operands in [low, high]) not in `skip` (which gains them)."""
    available = (high - low + 1) ** 2 - sum(1 for a, b in skip if low <= a <= high and low <= b <= high)
    if count > available:
        raise ValueError(f"asked for {count} questions but operands {low}-{high} leave only {available} unused pairs")
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    while len(out) < count:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair in skip:
            continue
        skip.add(pair)
        out.append({"prompt": STYLES[style](*pair), "ground_truth": str(sum(pair)), "data_source": "calc"})
    return out


def write(folder: Path, train: int, val: int, seed: int = 0, low: int = 10, high: int = 99, style: str = "few-shot") -> tuple[Path, Path]:
    """val.jsonl first, then train.jsonl from the pairs val did not take; neither asks an example's pair."""
    if not 0 <= low <= high:
        raise ValueError(f"operand range {low}-{high}: need 0 <= min-operand <= max-operand")
    if train < 1 or val < 0:
        raise ValueError(f"--train {train} --val {val}: need at least one train row and no negative count")
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set(EXAMPLES)
    paths = []
    for name, count, offset in (("val", val, 1), ("train", train, 0)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed * 2 + offset, low, high, seen, style)))
        paths.append(path)
    return paths[1], paths[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.make_calc_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/calc", help="folder for train.jsonl and val.jsonl")
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--val", type=int, default=64)
    p.add_argument("--min-operand", type=int, default=10)
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--style", choices=sorted(STYLES), default="few-shot",
                   help="few-shot: the agent_calc prompt; task: the bare question (agent_openai)")
    args = p.parse_args(argv)
    try:
        train, val = write(Path(args.out), args.train, args.val, args.seed, args.min_operand, args.max_operand, args.style)
    except ValueError as exc:
        p.error(str(exc))
    print(f"wrote {train} ({args.train} rows) and {val} ({args.val} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
