"""Writes the real-model recipe's data: addition word problems as chat JSONL files.

`python -m hfrt.bench.recipes.make_math_data --out runs/math` writes train.jsonl and val.jsonl (rows
{"prompt": [{"role": "user", "content": ...}], "ground_truth": "71", "data_source": "math2d"}),
disjoint, from a seed. It knows the row format of hfrt's data files and nothing of training.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATES = (
    "What is {a} + {b}? Reply with the number only.",
    "Compute {a} + {b}. Give just the result.",
)


def rows(count: int, seed: int, max_operand: int, skip: set[str]) -> list[dict[str, object]]:
    """`count` distinct questions not in `skip` (which gains them)."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    if count > len(TEMPLATES) * max_operand**2 - len(skip):
        raise ValueError(f"only {len(TEMPLATES) * max_operand**2} distinct questions with max_operand {max_operand}")
    while len(out) < count:
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        text = rng.choice(TEMPLATES).format(a=a, b=b)
        if text in skip:
            continue
        skip.add(text)
        out.append({"prompt": [{"role": "user", "content": text}], "ground_truth": str(a + b), "data_source": "sums"})
    return out


def write(folder: Path, train: int, val: int, seed: int, max_operand: int = 20) -> tuple[Path, Path]:
    """val.jsonl first, then train.jsonl from the questions val did not take."""
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    paths = []
    for name, count, offset in (("val", val, 1), ("train", train, 0)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed * 2 + offset, max_operand, seen)))
        paths.append(path)
    return paths[1], paths[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.make_math_data", description=__doc__)
    p.add_argument("--out", default="runs/math", help="folder for train.jsonl and val.jsonl")
    p.add_argument("--train", type=int, default=600)
    p.add_argument("--val", type=int, default=100)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train, val = write(Path(args.out), args.train, args.val, args.seed, args.max_operand)
    print(f"wrote {train} ({args.train} rows) and {val} ({args.val} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
