"""The seeds' pipeline on one task, one command each: SFT → reward model → PPO (InstructGPT's,
HybridFlow's "SFT → 训练奖励模型 → RLHF"), and SFT → DPO — every stage a built-in flow on the same
runtime, each stage's model the next one's starting point, each stage's figure printed as it ends.

`python -m hfrt.bench.recipes.rlhf_pipeline rlhf [--out FILE] [--work runs/pipeline] [--quick]`
`python -m hfrt.bench.recipes.rlhf_pipeline dpo  [--out FILE] [--work runs/pipeline] [--quick]`

On the built-in addition task (prompts "a+b=", the tiny preset):
1. `sft`: demonstrations "a+b=" → the sum, `sft_steps` steps (a short cold start: the policy has
   the answer's form, not yet the sums). Figure: held-out token accuracy, and the greedy rule
   accuracy of its export over every prompt of the task (9 of them).
2. `rm` (rlhf): the reward model on the task's preference pairs, its backbone the SFT model.
   Figure: held-out pair accuracy.
3. `ppo` (rlhf): actor, critic and reference start from the SFT model, the reward role serves the
   reward model (normalized by its held-out scores). Figure: the greedy rule accuracy of the
   trained policy (the reward model never saw the rule).
3'. `dpo` (dpo): policy and reference from the SFT model, one epoch of the task's preference pairs
   — the right sum preferred to a wrong one (`correctness_pairs`; the `rm` flow's default pairs
   mostly rank answer forms, which a reward model needs and a policy's DPO step does not), at a
   quarter of the flow's learning rate (DPO_LR). Figures:
   held-out reward accuracy (rewards/accuracies) and the greedy rule accuracy of the policy.

`--quick` runs each stage for a few steps (what tests/integration/test_pipeline_recipe.py runs).
It runs the CLI as a user does and reads the flows' summaries; nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.bench.recipes.rm_recipe import controller, rule_accuracy

QUIET = ("--set", "tensorboard=false", "--set", "trace=false", "--overwrite")
#: the DPO stage's learning rate: a quarter of the flow's default, which is for training from
#: scratch (at 2e-3 one epoch of these pairs took the SFT policy's greedy accuracy down, not up)
DPO_LR = 5e-4


@dataclass(frozen=True)
class Steps:
    """Each stage's length."""

    sft: int = 12
    rm: int = 450
    ppo: int = 300
    dpo: int = 57  # one epoch of 1800 training pairs, 32 a step

    @classmethod
    def quick(cls) -> Steps:
        return cls(sft=4, rm=8, ppo=4, dpo=4)


def say(stage: str, figures: dict[str, Any]) -> None:
    """One stage's figure, as it ends (stderr: stdout carries the JSON result)."""
    shown = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    print(f"[{stage}] {shown}", file=sys.stderr, flush=True)


def sft(work: Path, steps: Steps) -> dict[str, Any]:
    run = controller("--flow", "sft", "--run-dir", str(work / "sft"), "--set", f"max_steps={steps.sft}", *QUIET)
    out = {"model": run["hf_export"], "steps": run["steps"], "val_token_accuracy": run["val_token_accuracy"],
           "val_loss": run["val_loss"], "rule_accuracy": rule_accuracy(run["hf_export"], 2), "wall_s": run["wall_s"]}
    say("sft", {k: out[k] for k in ("steps", "val_token_accuracy", "rule_accuracy", "wall_s")})
    return out


def reward_model(work: Path, steps: Steps, base: str) -> dict[str, Any]:
    run = controller("--flow", "rm", "--run-dir", str(work / "rm"), "--set", f"max_steps={steps.rm}", "--set", "epochs=2",
                     "--set", "roles.reward_model.options.append_eos=false", "--set", f"roles.reward_model.options.model={base}", *QUIET)
    out = {"model": run["hf_export"], "steps": run["steps"], "val_accuracy": run["val_accuracy"],
           "val_accuracy_before": run.get("val_accuracy_before"), "wall_s": run["wall_s"]}
    say("rm", {k: out[k] for k in ("steps", "val_accuracy", "wall_s")})
    return out


def ppo(work: Path, steps: Steps, base: str, rm: str) -> dict[str, Any]:
    starts = [a for role in ("actor", "critic", "reference") for a in ("--set", f"roles.{role}.options.model={base}")]
    run = controller("--flow", "ppo", "--run-dir", str(work / "ppo"), "--set", f"steps={steps.ppo}", "--set", "val_every=0",
                     *starts, "--set", "roles.reward.options.kind=model", "--set", f"roles.reward.options.model={rm}",
                     "--set", "roles.reward.options.normalize=config", *QUIET)
    out = {"model": run["hf_export"], "steps": run["steps"], "reward_last_quarter": run["reward_last_quarter"],
           "rule_accuracy": rule_accuracy(run["hf_export"], 2), "wall_s": run["wall_s"]}
    say("ppo", {k: out[k] for k in ("steps", "rule_accuracy", "wall_s")})
    return out


def correctness_pairs(path: Path, count: int = 2000, seed: int = 0) -> Path:
    """`count` pairs of the addition task written to `path`: the right sum (+ EOS) chosen, another
    digit (+ EOS) rejected."""
    import random

    from hfrt.flows.pairs import EOS
    from hfrt.flows.tasks import AdditionTask

    rng, rows = random.Random(seed), AdditionTask(seed=seed, max_operand=2).batch(count)
    with path.open("w") as f:
        for prompt, truth in zip(rows["prompt"], rows["ground_truth"], strict=True):
            wrong = rng.choice([d for d in "0123456789" if d != truth])
            f.write(json.dumps({"prompt": prompt, "chosen": truth + EOS, "rejected": wrong + EOS}) + "\n")
    return path


def dpo(work: Path, steps: Steps, base: str) -> dict[str, Any]:
    pairs = correctness_pairs(work / "dpo-pairs.jsonl")
    run = controller("--flow", "dpo", "--run-dir", str(work / "dpo"), "--set", f"max_steps={steps.dpo}", "--set", f"data={pairs}",
                     "--set", f"roles.actor.options.model={base}", "--set", f"roles.reference.options.model={base}",
                     "--set", f"roles.actor.options.engine.optim.lr={DPO_LR}", *QUIET)
    out = {"model": run["hf_export"], "steps": run["steps"], "val_rewards_accuracies": run["val_rewards_accuracies"],
           "val_rewards_margins": run["val_rewards_margins"], "rule_accuracy": rule_accuracy(run["hf_export"], 2),
           "wall_s": run["wall_s"]}
    say("dpo", {k: out[k] for k in ("steps", "val_rewards_accuracies", "rule_accuracy", "wall_s")})
    return out


def run_chain(chain: str, work: Path, steps: Steps) -> dict[str, Any]:
    """Every stage of `chain` ("rlhf" or "dpo") in order; {stage: its figures}."""
    first = sft(work, steps)
    if chain == "dpo":
        return {"sft": first, "dpo": dpo(work, steps, first["model"])}
    rm = reward_model(work, steps, first["model"])
    return {"sft": first, "rm": rm, "ppo": ppo(work, steps, first["model"], rm["model"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chain", choices=("rlhf", "dpo"), help="rlhf: SFT → RM → PPO; dpo: SFT → DPO")
    parser.add_argument("--work", default="runs/pipeline", help="each stage's run folder goes here")
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--quick", action="store_true", help="a few steps per stage (a check that the chain runs)")
    args = parser.parse_args(argv)
    steps = Steps.quick() if args.quick else Steps()
    started = time.time()
    stages = run_chain(args.chain, Path(args.work) / args.chain, steps)
    result = {"chain": args.chain, "quick": args.quick, "load_avg": os.getloadavg(), "stages": stages,
              "wall_s": round(time.time() - started, 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
