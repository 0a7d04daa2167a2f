"""The slow documented figures, measured again and printed beside what the docs say: the check to
run before a commit that touches training (docs/design.md says when). Fast figures have tests
(tests/integration/test_doc_figures.py and the tests each page cites); these take minutes each.

`python -m hfrt.bench.recipes.figures --out bench/results/figures-DATE.json [--only ppo,rm,agent_calc,verifiers,gym]`

- `ppo`: README's main job, `hfrt controller --flow ppo` (500 steps) on seeds 0, 1, 2: greedy
  validation accuracy 0.97 / 1.0 / 0.91 (`val_accuracy_last`).
- `rm`: docs/reward-models.md's recipe (bench/recipes/rm_recipe.py): the reward model's held-out
  pair accuracy and best-of-candidates, and PPO against it graded by the rule (7/9 on seeds 0, 1).
- `agent_calc`: docs/agents-and-openai.md, the built-in calculator agent on the tiny preset: the
  reward rises from about 0.01 to 0.4-0.8 within 400 steps.
- `verifiers`: docs/agents-and-openai.md, a verifiers environment (the addition task with a digits
  format reward, bench/recipes/verifiers_envs/vf_addition.py) trained 30 steps by agent_openai on the
  tiny preset in its own venv: the reward rises (needs .venv-verifiers, made by .ci/install).
- `gym`: docs/real-models.md's reasoning-gym table (bench/recipes/gym_recipe.py, about 25 min): each
  task's greedy held-out accuracy after GRPO on SmolLM2-135M beats its own "before" by the margin
  and always giving the most common answer.
- `data_file`: docs/configuration.md's `run.toml`, cut out of the page and run on the addition
  task written as files (bench/recipes/make_addition_data.py): greedy validation accuracy 0.94.

Each figure has the band the docs' wording allows (a figure on a page is one run of a noisy
machine); the exit code is 1 when any falls outside. It runs the CLI as a user does and knows
the flows' summaries, nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hfrt.bench.recipes import make_addition_data
from hfrt.bench.recipes.rm_recipe import best_of_candidates, controller, rule_accuracy


@dataclass(frozen=True)
class Figure:
    """One documented number: where it is stated, what it says, the band it must fall in."""

    page: str
    what: str
    documented: float
    low: float
    high: float
    measured: float | None = None

    @property
    def holds(self) -> bool:
        return self.measured is not None and self.low <= self.measured <= self.high


def ppo_figures(work: Path) -> list[Figure]:
    documented = {0: 0.97, 1: 1.0, 2: 0.91}
    out = []
    for seed, value in documented.items():
        run = controller("--flow", "ppo", "--run-dir", str(work / f"ppo-seed{seed}"), "--overwrite", "--set", f"seed={seed}")
        out.append(Figure("README.md", f"ppo seed {seed}: val_accuracy_last ({run['wall_s']} s)", value, 0.85, 1.0,
                          run.get("val_accuracy_last")))
    return out


def rm_figures(work: Path) -> list[Figure]:
    rm = controller("--flow", "rm", "--run-dir", str(work / "rm"), "--overwrite", "--set", "epochs=2",
                    "--set", "roles.reward_model.options.append_eos=false")
    out = [
        Figure("docs/reward-models.md", "rm held-out pair accuracy", 1.0, 0.95, 1.0, rm["val_accuracy"]),
        Figure("docs/reward-models.md", "rm best-of-candidates", 1.0, 8 / 9, 1.0, best_of_candidates(rm["hf_export"], 2)),
    ]
    learned = ["--set", "roles.reward.options.kind=model", "--set", f"roles.reward.options.model={rm['hf_export']}",
               "--set", "roles.reward.options.normalize=config"]
    for seed in (0, 1):
        ppo = controller("--flow", "ppo", "--run-dir", str(work / f"ppo-learned-seed{seed}"), "--overwrite",
                         "--set", f"seed={seed}", *learned)
        out.append(Figure("docs/reward-models.md", f"ppo on the learned reward, seed {seed}: rule accuracy",
                          7 / 9, 6 / 9, 1.0, rule_accuracy(ppo["hf_export"], 2)))
    return out


def agent_calc_figures(work: Path) -> list[Figure]:
    run = controller("--flow", "agent_calc", "--run-dir", str(work / "agent-calc"), "--overwrite", "--set", "steps=400")
    return [
        Figure("docs/agents-and-openai.md", "agent_calc reward, first quarter of 400 steps", 0.01, 0.0, 0.1,
               run.get("reward_first_quarter")),
        Figure("docs/agents-and-openai.md", f"agent_calc reward, last quarter of 400 steps ({run['wall_s']} s)", 0.6,
               0.4, 1.0, run.get("reward_last_quarter")),
    ]


#: the verifiers environment the `verifiers` check trains (run by the verifiers venv's Python)
VERIFIERS_ENV = Path(__file__).resolve().parent / "verifiers_envs" / "vf_addition.py"


def verifiers_figures(work: Path) -> list[Figure]:
    sets = [f"verifiers_env={VERIFIERS_ENV}", "steps=30", "prompts_per_step=1", "n=8", "max_new_tokens=4",
            "max_total_tokens=200", "sample_timeout_s=300", "export_hf=false", "roles.actor.options.engine.optim.lr=0.004"]
    run = controller("--flow", "agent_openai", "--run-dir", str(work / "vf-addition"), "--overwrite",
                     *[a for s in sets for a in ("--set", s)])
    return [
        Figure("docs/agents-and-openai.md", "verifiers vf_addition reward, first quarter of 30 steps", 0.01, 0.0, 0.08,
               run.get("reward_first_quarter")),
        Figure("docs/agents-and-openai.md", f"verifiers vf_addition reward, last quarter of 30 steps ({run['wall_s']} s)",
               0.13, 0.08, 1.0, run.get("reward_last_quarter")),
    ]


#: the reasoning-gym figure of docs/real-models.md (bench/recipes/gym_recipe.py's committed result)
GYM_RESULTS = Path(__file__).resolve().parents[1] / "results" / "gym-smollm2-2026-11-27.json"


def gym_figures(work: Path) -> list[Figure]:
    """Each task of the reasoning-gym table trained again: its greedy "after" must beat its "before" by
    the margin and always giving the most common answer, as the page's wording ("learns") allows."""
    from hfrt.bench.recipes import gym_recipe

    documented = json.loads(GYM_RESULTS.read_text())
    out = []
    for task in documented["tasks"]:
        result = work / f"{task['task']}.json"
        gym_recipe.main(["--tasks", task["task"], "--work", str(work), "--out", str(result)])
        (measured,) = json.loads(result.read_text())["tasks"]
        low = max(measured["before"]["greedy"] + documented["margin"], measured["constant_answer"]["share"])
        out.append(Figure("docs/real-models.md", f"SmolLM2 {task['task']}: greedy held-out accuracy after 15 GRPO steps "
                          f"({measured['wall_s']['train']} s)", task["after"]["greedy"], round(low, 2), 1.0,
                          measured["after"]["greedy"]))
    return out


def documented_run_toml(page: Path) -> str:
    """The ```toml block of `page` that starts with `# run.toml`."""
    for block in re.findall(r"```toml\n(.*?)```", page.read_text(), re.S):
        if block.startswith("# run.toml"):
            return str(block)
    raise SystemExit(f"{page} has no ```toml block starting with '# run.toml'")


def data_file_figures(work: Path) -> list[Figure]:
    work.mkdir(parents=True, exist_ok=True)
    make_addition_data.write(work / "data", train=2048, val=64)
    (work / "run.toml").write_text(documented_run_toml(docs_page("configuration.md")))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--config", "run.toml",
                           "--run-dir", "run", "--overwrite", "--set", "progress=off"], cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the documented run.toml failed:\n{done.stderr[-4000:]}")
    run = json.loads(done.stdout[done.stdout.index("{"):])
    wall = round(time.perf_counter() - start, 1)
    return [Figure("docs/configuration.md", f"run.toml on addition data files: val_accuracy_last ({wall} s)", 0.94,
                   0.8, 1.0, run.get("val_accuracy_last"))]


def docs_page(name: str) -> Path:
    """A docs page of the checkout this runs from (bench/ is installed as hfrt.bench, an editable install)."""
    for base in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (base / "docs" / name).is_file():
            return base / "docs" / name
    raise SystemExit(f"docs/{name} not found: run from the repository root")


CHECKS = {"ppo": ppo_figures, "rm": rm_figures, "agent_calc": agent_calc_figures, "data_file": data_file_figures,
          "verifiers": verifiers_figures, "gym": gym_figures}


def table(figures: list[Figure]) -> str:
    rows = ["| page | figure | documented | measured | band | holds |", "|---|---|---|---|---|---|"]
    for f in figures:
        measured = "missing" if f.measured is None else f"{f.measured:.3f}"
        rows.append(f"| {f.page} | {f.what} | {f.documented:.3f} | {measured} | {f.low:.2f}-{f.high:.2f} | "
                    f"{'yes' if f.holds else 'NO'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/figures", help="where the runs go")
    parser.add_argument("--out", help="also write the figures as JSON here")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; use {', '.join(CHECKS)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    start, figures = time.perf_counter(), []
    for name in names:
        figures += CHECKS[name](work / name)
        print(table(figures), flush=True)
    result: dict[str, Any] = {"machine": "2 CPU cores (shared)", "wall_s": round(time.perf_counter() - start),
                              "figures": [asdict(f) | {"holds": f.holds} for f in figures]}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    held = sum(f.holds for f in figures)
    print(f"{held} of {len(figures)} figures hold")
    return 0 if held == len(figures) else 1


if __name__ == "__main__":
    raise SystemExit(main())
