"""On-policy distillation against PPO from scratch on the built-in addition task (tiny preset): how
many steps, and how much training time, each takes to reach a greedy validation accuracy of 0.9.

`python -m hfrt.bench.recipes.distill_vs_ppo --out bench/results/distill-vs-ppo-DATE.json [--seed 0]`

1. `hfrt controller --flow ppo --set val_every=10` (its 500 default steps): PPO from scratch, and
   the teacher — its RUN_DIR/hf export.
2. `hfrt controller --flow distill --set val_every=10 --set steps=300` with
   `roles.teacher.options.model=PPO_RUN/hf`: a fresh tiny student distilled from it.

For each run: the first validation at or above the threshold (`steps`: steps done then) and the
training time up to it (`train_s`: the sum of its steps' `timing/step_s`, validation passes left
out), and the whole run's wall time. Both runs validate on the same 32 held-out prompts with the
same seed. It runs the CLI as a user does and reads the metrics files; nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from hfrt.bench.recipes.rm_recipe import controller

THRESHOLD = 0.9
QUIET = ("--set", "tensorboard=false", "--set", "trace=false", "--overwrite")


def first_reaching(run_dir: Path, threshold: float = THRESHOLD) -> dict[str, Any]:
    """The first validation at or above `threshold`: {"steps", "train_s", "accuracy"} (None when never),
    and every validation as [steps done, accuracy]."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve, train_s, reached = [], 0.0, None
    for record in records:
        train_s += float(record.get("timing/step_s", 0.0))
        if "val/accuracy" not in record:
            continue
        done = record["step"] + 1
        curve.append([done, record["val/accuracy"]])
        if reached is None and record["val/accuracy"] >= threshold:
            reached = {"steps": done, "train_s": round(train_s, 2), "accuracy": record["val/accuracy"]}
    return {"reached": reached, "curve": curve, "total_train_s": round(train_s, 2)}


def run(work: Path, seed: int, distill_steps: int) -> dict[str, Any]:
    ppo_dir, distill_dir = work / "ppo", work / "distill"
    ppo = controller("--flow", "ppo", "--run-dir", str(ppo_dir), "--set", f"seed={seed}", "--set", "val_every=10", *QUIET)
    distill = controller("--flow", "distill", "--run-dir", str(distill_dir), "--set", f"seed={seed}", "--set", "val_every=10",
                         "--set", f"steps={distill_steps}", "--set", f"roles.teacher.options.model={ppo['hf_export']}", *QUIET)
    out: dict[str, Any] = {"ppo": {"wall_s": ppo["wall_s"], "val_accuracy_last": ppo.get("val_accuracy_last"), **first_reaching(ppo_dir)},
           "distill": {"wall_s": distill["wall_s"], "val_accuracy_last": distill.get("val_accuracy_last"), **first_reaching(distill_dir)}}
    a, b = out["distill"]["reached"], out["ppo"]["reached"]
    out["distill_fewer_steps_and_less_time"] = bool(a and b and a["steps"] < b["steps"] and a["train_s"] < b["train_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--work", default="runs/distill-vs-ppo", help="the two runs' folders go here")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (data order and sampling)")
    parser.add_argument("--distill-steps", type=int, default=300, help="steps of the distillation run")
    args = parser.parse_args(argv)
    started = time.time()
    result = {"seed": args.seed, "threshold": THRESHOLD, "load_avg": os.getloadavg(),
              **run(Path(args.work), args.seed, args.distill_steps), "bench_wall_s": round(time.time() - started, 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["distill_fewer_steps_and_less_time"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
