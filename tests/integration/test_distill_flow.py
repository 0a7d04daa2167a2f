"""`hfrt controller --flow distill` on real daemons and the tiny preset: the committed figure is the
page's, and a fresh student distilled
from a trained teacher reaches 0.9 greedy validation accuracy on the addition task sooner than PPO
from scratch did in the committed figure (bench/results/distill-vs-ppo-2026-11-27.json, PPO's own
run and its export as the teacher: docs/pipeline.md); here, to run in about a minute, the teacher
is a 20-step SFT model (hfrt controller --flow sft), and the reverse KL to it falls as the student
learns. A LoRA student distils too (the teacher is its own role, never the actor's adapters-off
model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hfrt.bench.recipes.distill_vs_ppo import first_reaching

ROOT = Path(__file__).resolve().parents[2]
FIGURE = ROOT / "bench" / "results" / "distill-vs-ppo-2026-11-27.json"
QUIET = ("--set", "progress=off", "--set", "tensorboard=false", "--set", "trace=false", "--set", "export_hf=false")


def summary(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "hfrt", "controller", *args], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout[done.stdout.index("{"):]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_distilled_student_reaches_09_sooner_than_ppo_from_scratch(tmp_path: Path) -> None:
    teacher = tmp_path / "teacher"
    summary("--flow", "sft", "--run-dir", str(teacher), "--set", "max_steps=20", *QUIET[:-2])
    run = tmp_path / "distill"
    done = summary("--flow", "distill", "--run-dir", str(run), "--set", "steps=200", "--set", "val_every=20",
                   "--set", f"roles.teacher.options.model={teacher / 'hf'}", *QUIET)
    reached = first_reaching(run)["reached"]
    ppo = json.loads(FIGURE.read_text())["ppo"]["reached"]
    assert reached is not None, first_reaching(run)["curve"]
    assert reached["steps"] < ppo["steps"] and done["val_accuracy_last"] >= 0.9
    kl = [json.loads(line)["kl/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(kl[-20:]) / 20 < 0.5 * sum(kl[:20]) / 20  # the student's reverse KL to its teacher falls


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lora_student_distils_from_its_teacher_role(tmp_path: Path) -> None:
    run = tmp_path / "lora"
    done = summary("--flow", "distill", "--run-dir", str(run), "--set", "steps=3", "--set", "val_every=0",
                   "--set", "roles.teacher.options.seed=1", "--set", "roles.actor.options.lora.rank=8",
                   "--set", "roles.actor.options.lora.target_modules=all-linear", *QUIET)
    assert done["steps"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["kl/mean"] != 0.0 and r["actor/grad_norm"] > 0 for r in records)  # a teacher other than the student
    assert "teacher" in json.loads((run / "config.json").read_text())["roles"]


def test_the_committed_figure_is_the_pages() -> None:
    """docs/pipeline.md's table is bench/results/distill-vs-ppo-2026-11-27.json."""
    figure = json.loads(FIGURE.read_text())
    assert figure["distill_fewer_steps_and_less_time"] is True
    assert (figure["ppo"]["reached"]["steps"], figure["ppo"]["reached"]["train_s"]) == (300, pytest.approx(30.2, abs=0.05))
    assert (figure["distill"]["reached"]["steps"], figure["distill"]["reached"]["train_s"]) == (160, pytest.approx(11.5, abs=0.05))
    page = (ROOT / "docs" / "pipeline.md").read_text()
    assert "step 300 (0.97" in page and "**step 160** (0.97" in page and "**11.5 s**" in page and "| 30.2 s |" in page


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distill_async_trains_a_lora_student_on_stale_samples_within_the_bound(tmp_path: Path) -> None:
    """`--flow distill_async` (the rollout role samples up to max_staleness=1 versions behind): every
    step's advantages come from the teacher role (its reverse KL is the record's kl/mean, never 0
    with a teacher of other weights), the student learns (a gradient every step), no sample lags
    more than one version and steps after the first train on one-version-old samples; a LoRA
    student syncs only its adapters to the rollout role."""
    run = tmp_path / "async"
    done = summary("--flow", "distill_async", "--run-dir", str(run), "--set", "steps=3", "--set", "val_every=0",
                   "--set", "prompts_per_step=8", "--set", "max_staleness=1", "--set", "roles.teacher.options.seed=1",
                   "--set", "roles.actor.options.lora.rank=8", "--set", "roles.actor.options.lora.target_modules=all-linear",
                   *QUIET)
    assert done["steps"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["kl/mean"] != 0.0 and r["actor/grad_norm"] > 0 for r in records)
    assert all(r["async/staleness_max"] <= 1 for r in records)
    assert [r["async/staleness_max"] for r in records[1:]] == [1.0, 1.0]  # the rollout ran one version ahead
    assert all(r["timing/old_log_prob_s"] > 0 for r in records)  # the current student's log-probs, every step
    roles = json.loads((run / "config.json").read_text())["roles"]
    assert {"rollout", "teacher"} <= set(roles) and roles["rollout"]["options"]["lora"]["rank"] == 8
    sync = [r["sync/bytes"] for r in records if "sync/bytes" in r]
    assert sync and max(sync) < 1_000_000  # adapters only (the tiny model's weights are larger)
