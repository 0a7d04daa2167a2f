"""The reasoning-gym figure of docs/real-models.md, measured: GRPO on SmolLM2-135M-Instruct over
reasoning-gym tasks (bench/recipes/smollm2-gym-TASK.toml, vLLM generation in fp32), with each task's
held-out accuracy before and after training, greedy and sampled, on the same validation rows
(reasoning-gym seeds the training rows never use: hfrt/flows/gym_data.py).

`python -m hfrt.bench.recipes.gym_recipe --out bench/results/gym-smollm2-2026-11-27.json
[--tasks chain_sum,basic_arithmetic] [--steps N] [--margin 0.05] [--val-temperature 0.7] [--val-n 4] [--append]`

Per task, on one set of daemons kept between its runs (`--keep-daemons`, then `--attach`, as
docs/deploy.md describes), each run `hfrt controller --flow grpo --config RECIPE` as a user runs it:
1. `val_only` with `val_temperature`/`val_n`: the sampled accuracy of the starting weights;
2. the recipe's training run: its own greedy validation before the first step (`val_before/accuracy`)
   and after the last (the last `val/accuracy`);
3. `val_only` sampled again: the trained weights, which the daemons keep between runs;
then `hfrt stop`. The JSON holds the four accuracies, every validation pass, the training reward per
step, the recipe's settings and the overrides, the wall time of each run and the load (`uptime`)
around them, and the held-out rows' most common answer with its share. Exit 1 when any task's
"after" does not beat its "before" by `--margin` (greedy and sampled alike), or its greedy "after"
does not beat always giving that answer: the check that guards the figure. It knows the recipes, the CLI and the run
folder's files, nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

RECIPES = Path(__file__).resolve().parent
#: the tasks of the committed figure, each with its recipe smollm2-gym-TASK.toml
TASKS = ("chain_sum", "basic_arithmetic")
#: "after" must beat "before" by this much (accuracy, 0-1) in both the greedy and the sampled pass
MARGIN = 0.05


def recipe(task: str) -> Path:
    path = RECIPES / f"smollm2-gym-{task}.toml"
    if not path.is_file():
        raise SystemExit(f"--tasks {task}: no recipe {path} (the recipes are bench/recipes/smollm2-gym-*.toml)")
    return path


def recipes(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(task, recipe file) of each task to measure: --config's file alone (its data's task), else --tasks'."""
    if args.config is not None:
        data = str(tomllib.loads(args.config.read_text()).get("data", ""))
        if not data.startswith("reasoning_gym:"):
            raise SystemExit(f"--config {args.config}: data={data!r} is not a reasoning_gym:TASK")
        return [(data.removeprefix("reasoning_gym:"), args.config.resolve())]
    return [(task, recipe(task)) for task in args.tasks.split(",") if task]


def load() -> dict[str, Any]:
    """The machine's load around a run: `uptime`'s line and the 1/5/15-minute averages."""
    line = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": line, "load_avg": [round(x, 2) for x in os.getloadavg()]}


def controller(config: Path, run_dir: Path, daemons: list[str], sets: list[str]) -> dict[str, Any]:
    """One `hfrt controller --flow grpo` run: its summary, records, wall time and the load around it."""
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--config", str(config),
            "--run-dir", str(run_dir), "--overwrite", *daemons]
    for item in ["progress=off", *sets]:
        args += ["--set", item]
    load_before, start = load(), time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    wall = round(time.perf_counter() - start, 1)
    if done.returncode != 0:
        raise RunFailed(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    return {"summary": summary, "records": records, "wall_s": wall, "load_before": load_before, "load_after": load(),
            "command": " ".join(args[2:])}


class RunFailed(RuntimeError):
    """A controller run exited non-zero (its command and the end of its stderr)."""


def sampled(value: float, n: int) -> list[str]:
    return ["val_only=true", f"val_temperature={value}", f"val_n={n}"]


def measure_task(task: str, config: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The three runs of one task on one set of kept daemons, stopped at the end."""
    folder = work / task
    attach = folder / "before" / "attach.json"
    overrides = [f"steps={args.steps}"] if args.steps else []
    overrides += args.set
    try:
        before = controller(config, folder / "before", ["--keep-daemons"], [*overrides, *sampled(args.val_temperature, args.val_n)])
        print(f"{task}: before, sampled: {before['summary']['val/accuracy']}", flush=True)
        train = controller(config, folder / "train", ["--attach", str(attach)], overrides)
        print(f"{task}: trained {train['wall_s']} s: {train['summary'].get('val_accuracy_first')} -> "
              f"{train['summary'].get('val_accuracy_last')} greedy", flush=True)
        after = controller(config, folder / "after", ["--attach", str(attach)], [*overrides, *sampled(args.val_temperature, args.val_n)])
        print(f"{task}: after, sampled: {after['summary']['val/accuracy']}", flush=True)
    finally:
        if attach.is_file():
            subprocess.run([sys.executable, "-m", "hfrt", "stop", str(attach)], capture_output=True, text=True)
    return summarize(task, config, overrides, before, train, after, args)


def summarize(task: str, config: Path, overrides: list[str], before: dict[str, Any], train: dict[str, Any],
              after: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A task's figure: accuracies before / after (greedy, sampled), the curves and what ran."""
    records = train["records"]
    val = [{"step": r["step"], "accuracy": r["val/accuracy"]} for r in records if "val/accuracy" in r]
    greedy_before = next(r["val_before/accuracy"] for r in records if "val_before/accuracy" in r)
    steady = [r["timing/step_s"] for r in records[1:] if "timing/step_s" in r]
    settings = tomllib.loads(config.read_text())
    return {
        "task": task,
        "recipe": str(config.relative_to(RECIPES.parent.parent)) if config.is_relative_to(RECIPES.parent.parent) else str(config),
        "settings": {k: v for k, v in settings.items() if k != "roles"}, "roles": settings.get("roles", {}),
        "overrides": overrides,
        "val_prompts": before["summary"]["val_prompts"], "constant_answer": constant_answer(config),
        "sampled": {"temperature": args.val_temperature, "n": args.val_n},
        "before": {"greedy": greedy_before, "sampled": before["summary"]["val/accuracy"]},
        "after": {"greedy": val[-1]["accuracy"], "sampled": after["summary"]["val/accuracy"]},
        "greedy_validation": [{"step": -1, "accuracy": greedy_before}, *val],
        "train_reward_mean": [round(float(r["reward/mean"]), 4) for r in records if "reward/mean" in r],
        "steps": len(records),
        "median_step_s": round(statistics.median(steady), 1) if steady else None,
        "wall_s": {"before_sampled": before["wall_s"], "train": train["wall_s"], "after_sampled": after["wall_s"]},
        "load": {"before_sampled": before["load_before"], "train_start": train["load_before"],
                 "train_end": train["load_after"], "after_sampled": after["load_after"]},
        "commands": [before["command"], train["command"], after["command"]],
    }


def constant_answer(config: Path) -> dict[str, Any]:
    """The held-out rows' most common answer and its share: what a policy that always gives it
    scores (a task whose answers are mostly one value can look learnt by learning that value)."""
    from collections import Counter

    from hfrt.flows.gym_data import gym_task

    settings = tomllib.loads(config.read_text())
    task = gym_task(settings["data"], settings.get("data_options", {}), seed=int(settings.get("seed", 0)))
    answers = Counter(str(a) for a in task.validation_rows(int(settings.get("val_prompts", 32)))["ground_truth"])
    answer, count = answers.most_common(1)[0]
    return {"answer": answer, "share": round(count / sum(answers.values()), 4)}


def failures(result: dict[str, Any], margin: float, *, constant_check: bool = True) -> list[str]:
    """Each task whose "after" does not beat "before" by `margin`, greedy or sampled, or whose greedy
    "after" does not beat always giving the most common held-out answer."""
    out = []
    for figure in result["tasks"]:
        constant = figure["constant_answer"]
        if constant_check and figure["after"]["greedy"] <= constant["share"]:
            out.append(f"{figure['task']} greedy: {figure['after']['greedy']:.3f} is no better than always answering "
                       f"{constant['answer']!r} ({constant['share']:.3f})")
        for kind in ("greedy", "sampled"):
            gain = figure["after"][kind] - figure["before"][kind]
            if gain < margin:
                out.append(f"{figure['task']} {kind}: {figure['before'][kind]:.3f} -> {figure['after'][kind]:.3f} "
                           f"(gain {gain:+.3f} < {margin})")
    return out


def kept(args: argparse.Namespace) -> list[dict[str, Any]]:
    """With --append, the tasks --out already holds that this invocation does not measure again."""
    if not args.append or not args.out or not Path(args.out).is_file():
        return []
    names = {task for task, _ in recipes(args)}
    earlier = json.loads(Path(args.out).read_text())
    return [{"constant_answer": constant_answer(RECIPES.parent.parent / t["recipe"]), **t, "command": earlier.get("command")}
            for t in earlier.get("tasks", []) if t["task"] not in names]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.recipes.gym_recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks, each with bench/recipes/smollm2-gym-TASK.toml")
    p.add_argument("--work", default="runs/gym-recipe", help="folder for the run folders")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: the recipe's)")
    p.add_argument("--margin", type=float, default=MARGIN, help="accuracy gain 'after' must show over 'before'")
    p.add_argument("--no-constant-check", action="store_true",
                   help="do not require the greedy 'after' to beat always giving the most common answer (plumbing tests)")
    p.add_argument("--val-temperature", type=float, default=0.7, help="temperature of the sampled passes (the recipes sample rollouts at 0.7)")
    p.add_argument("--val-n", type=int, default=4, help="samples per held-out prompt in the sampled passes")
    p.add_argument("--config", type=Path, help="one recipe file to run instead of --tasks' recipes (e.g. a tiny-preset one)")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to every run (repeatable)")
    p.add_argument("--append", action="store_true",
                   help="keep the other tasks --out already holds (one task measured per invocation); the check covers them all")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from hfrt.bench.common import machine

    work, start = Path(args.work), time.perf_counter()
    result: dict[str, Any] = {"command": "python -m hfrt.bench.recipes.gym_recipe " + " ".join(sys.argv[1:] if argv is None else argv),
                              "margin": args.margin, "load_start": load(), "tasks": []}
    measured = [measure_task(task, config, work, args) for task, config in recipes(args)]
    result["tasks"] = kept(args) + measured
    result |= {"wall_s": round(time.perf_counter() - start, 1), "load_end": load()} | machine()
    failed = failures(result, args.margin, constant_check=not args.no_constant_check)
    result["passed"], result["failures"] = not failed, failed
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({t["task"]: {"before": t["before"], "after": t["after"]} for t in result["tasks"]}))
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
