"""Writes the real-model recipe's data: two-digit arithmetic word prompts as chat JSONL files.

`python -m bench.recipes.make_math_data --out runs/math` writes train.jsonl and val.jsonl (rows
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
    "What is {c} - {d}? Reply with the number only.",
)


def rows(count: int, seed: int, skip: set[str]) -> list[dict[str, object]]:
    """`count` distinct questions not in `skip` (which gains them)."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    while len(out) < count:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        template = rng.choice(TEMPLATES)
        c, d = max(a, b), min(a, b)
        text = template.format(a=a, b=b, c=c, d=d)
        if text in skip:
            continue
        skip.add(text)
        answer = c - d if "-" in template else a + b
        out.append({"prompt": [{"role": "user", "content": text}], "ground_truth": str(answer), "data_source": "math2d"})
    return out


def write(folder: Path, train: int, val: int, seed: int) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    paths = []
    for name, count, offset in (("val", val, 1), ("train", train, 0)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed * 2 + offset, seen)))
        paths.append(path)
    return paths[1], paths[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recipes.make_math_data", description=__doc__)
    p.add_argument("--out", default="runs/math", help="folder for train.jsonl and val.jsonl")
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train, val = write(Path(args.out), args.train, args.val, args.seed)
    print(f"wrote {train} ({args.train} rows) and {val} ({args.val} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
