"""RLHF with a learned reward model end to end, as a user runs it: `hfrt controller --flow rm`
trains on preference pairs (checkpoints, resume), exports a folder that transformers loads as
AutoModelForSequenceClassification, and `hfrt controller --flow ppo` runs with that folder as
its reward role; the same flow on two FSDP2 ranks; a model folder without a score head is
refused before any daemon starts; and the recipe of docs/reward-models.md reaches the held-out
pair accuracy that page states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.pairs import addition_pairs


def hfrt(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=timeout)


def summary(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout[done.stdout.index("{"):]))


def pair_file(tmp_path: Path, count: int = 60) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_pairs(count, seed=0, max_operand=2)))
    return path


RM = ("--flow", "rm", "--set", "pairs_per_step=8", "--set", "val_every=1", "--set", "progress=off",
      "--set", "tensorboard=false", "--set", "roles.reward_model.options.append_eos=false")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_resume_export_then_ppo_on_it(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    data, run = pair_file(tmp_path), tmp_path / "rm"
    first = summary(hfrt("controller", *RM, "--set", f"data={data}", "--set", "max_steps=2",
                         "--set", "checkpoint_every=1", "--set", "export_hf=false", "--run-dir", str(run)))
    assert first["steps"] == 2 and (first["train_pairs"], first["val_pairs"]) == (54, 6)
    assert 0.0 <= first["val_accuracy"] <= 1.0 and "hf_export" not in first
    second = summary(hfrt("controller", "--flow", "rm", "--resume", str(run), "--set", "max_steps=3", "--set", "export_hf=true"))
    assert second["resumed_from_step"] == 2 and second["steps"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["rm/pairs"] == 8 and "val/accuracy" in r for r in records)

    model = AutoModelForSequenceClassification.from_pretrained(second["hf_export"])
    assert model.config.num_labels == 1 and model.config.hfrt_score_at == "last"
    assert model.config.std > 0  # the last validation's score spread, for normalize = "config"

    ppo = summary(hfrt(
        "controller", "--flow", "ppo", "--run-dir", str(tmp_path / "ppo"), "--set", "steps=2",
        "--set", "prompts_per_step=8", "--set", "val_every=0", "--set", "export_hf=false",
        "--set", "progress=off", "--set", "tensorboard=false",
        "--set", "roles.reward.options.kind=model", "--set", f"roles.reward.options.model={second['hf_export']}",
        "--set", "roles.reward.options.normalize=config", "--set", "roles.reward.options.clip=5",
    ))
    assert ppo["steps"] == 2 and -5.0 <= ppo["reward_first"] <= 5.0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_documented_recipe_reaches_its_held_out_accuracy(tmp_path: Path) -> None:
    """docs/reward-models.md: `--flow rm --set epochs=2 --set roles.reward_model.options.append_eos=false`
    (8000 rule-labelled pairs, 450 steps) ends at held-out pair accuracy 0.994 (0.56 before
    training, mean margin 8.7); asserted: at least 0.95 after, a margin above 4. Pairs split or
    trimmed so that chosen and rejected score alike end near chance (0.24 was seen)."""
    done = summary(hfrt("controller", "--flow", "rm", "--run-dir", str(tmp_path / "rm"), "--set", "epochs=2",
                        "--set", "roles.reward_model.options.append_eos=false", "--set", "progress=off",
                        "--set", "tensorboard=false", timeout=380))
    assert done["steps"] == 450 and done["val_pairs"] == 800
    assert done["val_accuracy"] >= 0.95, done
    assert done["val_margin_mean"] > 4.0, done
    assert done["val_accuracy_before"] < 0.8, done  # the figure is learned, not there from the start


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_fsdp2_ranks(tmp_path: Path) -> None:
    done = summary(hfrt(
        "controller", *RM, "--set", f"data={pair_file(tmp_path)}", "--set", "max_steps=2",
        "--set", "roles.reward_model.world_size=2", "--set", "roles.reward_model.options.engine.backend=fsdp2",
        "--run-dir", str(tmp_path / "rm2"),
    ))
    records = [json.loads(line) for line in Path(done["metrics"]).read_text().splitlines()]
    assert [r["rm/pairs"] for r in records] == [8, 8]  # both ranks' pairs in one loss
    assert done["val_pairs"] == 6 and Path(done["hf_export"], "model.safetensors").exists()


def test_a_folder_without_a_score_head_is_refused_before_launch(tmp_path: Path) -> None:
    from hfrt.roles.models import materialize

    plain = materialize("tiny")  # a causal LM: no score head
    done = hfrt("controller", "--flow", "ppo", "--run-dir", str(tmp_path / "run"), "--set", "steps=1",
                "--set", "roles.reward.options.kind=model", "--set", f"roles.reward.options.model={plain}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no score head" in done.stderr and str(plain) in done.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no daemon was started
