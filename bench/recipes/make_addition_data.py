"""Writes the built-in addition task as data files, for trying hfrt's data-file path on the tiny preset.

`python -m hfrt.bench.recipes.make_addition_data --out data` writes train.jsonl and val.jsonl (rows
{"prompt": "3+4=", "ground_truth": "7", "data_source": "addition"}) from the task's own generator
(hfrt.flows.tasks.AdditionTask), train and val from different seeds; the reward role scores
`data_source = "addition"` rows with the task's rule. It knows the row format of hfrt's data files
and nothing of training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hfrt.flows.tasks import AdditionTask


def write(folder: Path, train: int, val: int, seed: int = 0, max_operand: int = 2) -> tuple[Path, Path]:
    """train.jsonl (seed 2·seed) and val.jsonl (seed 2·seed + 1) in `folder`; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count, task_seed in (("train", train, 2 * seed), ("val", val, 2 * seed + 1)):
        cols = AdditionTask(seed=task_seed, max_operand=max_operand).batch(count)
        rows = [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.make_addition_data", description=__doc__)
    p.add_argument("--out", default="data", help="folder for train.jsonl and val.jsonl")
    p.add_argument("--train", type=int, default=2048, help="training rows")
    p.add_argument("--val", type=int, default=64, help="validation rows")
    p.add_argument("--max-operand", type=int, default=2, help="largest addend (the built-in task's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task's generator")
    args = p.parse_args(argv)
    train, val = write(Path(args.out), args.train, args.val, args.seed, args.max_operand)
    print(f"wrote {train} ({args.train} rows) and {val} ({args.val} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
