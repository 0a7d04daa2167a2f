"""The learned-reward recipe of docs/reward-models.md, measured: write rule-labelled preference
pairs for the addition task, train a reward model on them (`hfrt controller --flow rm`), then run
`hfrt controller --flow ppo` twice per seed — once with the rule reward, once with the learned
reward model as the reward role — and grade both exported policies by the rule.

`python -m hfrt.bench.recipes.rm_recipe --work runs/rm-recipe --out bench/results/rm-recipe.json`

Reported: the reward model's held-out pair accuracy and mean margin, its best-of-candidates
accuracy (per prompt, the response it scores highest among every response of one or two
characters is right by the rule: a reward model PPO cannot exploit in the actor's response form
scores 1), and per seed and reward the
policy's greedy accuracy by the rule on every prompt of the task (all a+b with a, b <= max_operand),
with its wall time. The PPO runs' own `val_accuracy_last` is the share of validation scores >= 1
under the reward they trained with, meaningful only for the rule reward. It runs the CLI as a
user does; it knows the flows' settings and the task, nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hfrt.flows.pairs import EOS
from hfrt.flows.tasks import addition_reward


def controller(*args: str) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hfrt", "controller", *args, "--set", "progress=off"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"hfrt controller {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    out = dict(json.loads(done.stdout[done.stdout.index("{"):]))
    return out | {"wall_s": round(time.perf_counter() - start, 1)}


def rule_accuracy(model_dir: str, max_operand: int) -> float:
    """Greedy accuracy by the rule reward on every prompt a+b of the task (the ppo flow's 2 new tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    questions = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    enc = tok([f"{a}+{b}=" for a, b in questions], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(addition_reward(t, a + b) == 1.0 for t, (a, b) in zip(texts, questions, strict=True)) / len(questions)


def best_of_candidates(rm_dir: str, max_operand: int) -> float:
    """Share of prompts whose highest-scored response, among EOS alone and every response of one
    character + EOS or two characters (digits, letters, punctuation, space, newline), is right."""
    import string

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    tok.padding_side = "left"
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    candidates = [EOS] + [c + EOS for c in chars] + [c + d for c in chars for d in chars]
    right = 0
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            enc = tok([f"{a}+{b}={c}" for c in candidates], return_tensors="pt", padding=True)
            with torch.no_grad():
                best = candidates[int(model(**enc).logits[:, 0].argmax())]
            right += addition_reward(best.replace(EOS, ""), a + b) == 1.0
    return right / (max_operand + 1) ** 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/rm-recipe", help="where the pairs and the runs go")
    parser.add_argument("--out", help="also write the figures as JSON here")
    parser.add_argument("--seeds", default="0", help="PPO seeds, comma-separated")
    parser.add_argument("--pairs", type=int, default=8000)
    parser.add_argument("--rm-epochs", type=int, default=2)
    parser.add_argument("--ppo-steps", type=int, default=500)
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rm = controller("--flow", "rm", "--run-dir", str(work / "rm"), "--overwrite", "--set", f"pairs_count={args.pairs}",
                    "--set", f"epochs={args.rm_epochs}", "--set", "roles.reward_model.options.append_eos=false")
    result: dict[str, Any] = {
        "machine": "2 CPU cores (shared)", "preset": "tiny", "pairs": args.pairs,
        "reward_model": {k: rm[k] for k in ("steps", "train_pairs", "val_pairs", "val_accuracy", "val_accuracy_before",
                                            "val_margin_mean", "wall_s")}
        | {"best_of_candidates_accuracy": best_of_candidates(rm["hf_export"], 2)},
        "ppo_steps": args.ppo_steps, "runs": [],
    }
    learned = ["--set", "roles.reward.options.kind=model", "--set", f"roles.reward.options.model={rm['hf_export']}",
               "--set", "roles.reward.options.normalize=config"]
    for seed in [int(s) for s in args.seeds.split(",")]:
        for reward, extra in (("rule", []), ("learned", learned)):
            run = work / f"ppo-{reward}-seed{seed}"
            ppo = controller("--flow", "ppo", "--run-dir", str(run), "--overwrite", "--set", f"seed={seed}",
                             "--set", f"steps={args.ppo_steps}", *extra)
            result["runs"].append({
                "seed": seed, "reward": reward, "rule_accuracy": rule_accuracy(ppo["hf_export"], 2),
                "val_accuracy_last_under_own_reward": ppo.get("val_accuracy_last"), "wall_s": ppo["wall_s"],
            })
            print(json.dumps(result["runs"][-1]), flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
