"""Every built-in flow with two actor ranks, two critic ranks and two reference ranks (fsdp2), on
real daemons, for two steps: each step's metrics present and finite, the per-rank update metrics
reduced once (an optimizer-step count or a learning rate is not summed over ranks), checkpoints,
the HF export and --resume with two ranks.

One set of daemons serves every flow: `safe_rlhf` (whose roles are a superset of every other
built-in flow's) launches them with --keep-daemons, the other flows attach to them. Starting
eight daemons is most of this module's time; a flow on warm daemons takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hfrt.flows.recipes.ppo import ROLES

#: two ranks on fsdp2 for every trained or forward-only model role
TWO_RANKS = tuple(
    f"roles.{role}.{key}" for role in ("actor", "critic", "reference")
    for key in ("world_size=2", "options.engine.backend=fsdp2")
)
#: every flow: 2 steps of 4 prompts, 2 PPO epochs of one optimizer step each (2 steps per update)
COMMON = ("steps=2", "prompts_per_step=4", "ppo_epochs=2", "tensorboard=false", "progress=off")
#: per flow: what keeps it tiny, and whether it trains a critic
FLOWS: dict[str, tuple[tuple[str, ...], bool]] = {
    "ppo": ((), True),
    "grpo": (("n=2",), False),
    "rloo": (("n=2",), False),
    "reinforce_pp": ((), False),
    "remax": ((), False),
    "dapo": (("n=4",), False),
}
LR = float(ROLES["actor"]["options"]["engine"]["optim"]["lr"])


@dataclass(frozen=True)
class Warm:
    """The launching run (safe_rlhf) and its attach file."""

    run_dir: Path
    attach: Path
    summary: dict


def controller(*args: str, timeout_s: float = 150) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout[: out.stdout.rindex("}") + 1])


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Warm]:
    """safe_rlhf for two steps with every role at two ranks, a checkpoint a step, validation and
    the HF export; its daemons stay up for the other flows and are stopped at the end."""
    run_dir = tmp_path_factory.mktemp("multirank") / "safe_rlhf"
    args = ["--flow", "safe_rlhf", "--run-dir", str(run_dir), "--keep-daemons", *sets(
        *COMMON, *TWO_RANKS, "export_hf=true", "checkpoint_every=1", "val_every=2", "val_prompts=4")]
    # its own session (the local launcher gives each daemon a session of its own: `hfrt stop` ends them)
    proc = subprocess.Popen([sys.executable, "-m", "hfrt", "controller", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=200)
        assert proc.returncode == 0, err[-4000:]
        yield Warm(run_dir, run_dir / "attach.json", json.loads(out[: out.rindex("}") + 1]))
    finally:
        if (run_dir / "attach.json").exists():
            subprocess.run([sys.executable, "-m", "hfrt", "stop", str(run_dir / "attach.json")], capture_output=True, timeout=60)
        stop_group(proc.pid)


def stop_group(pgid: int) -> None:
    """SIGTERM to the launching process group (a daemon exits cleanly on it, as on `hfrt stop`),
    SIGKILL to whatever is left after 30 s."""
    deadline = time.monotonic() + 30
    try:
        os.killpg(pgid, signal.SIGTERM)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.killpg(pgid, 0)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: every daemon exited


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_steps(rows: list[dict], *, critic: bool) -> None:
    """Each step's metrics are there and finite; each trained role's update metrics are the
    group's, reduced once: 2 optimizer steps (a sum over 2 ranks gives 4) at the configured
    learning rate (a sum gives twice it)."""
    assert [r["step"] for r in rows] == list(range(len(rows)))
    roles = ("actor", "critic") if critic else ("actor",)
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {r['step']}: not finite: {bad}"
        if r.get("dapo/kept_groups") == 0.0:
            continue  # DAPO kept no group with a reward spread: no update this step
        for role in roles:
            wanted = [f"{role}/loss", f"{role}/grad_norm", f"{role}/lr", f"{role}/optimizer_steps", f"timing/update_{role}_s"]
            missing = [k for k in wanted + ["reward/mean", "timing/step_s"] if k not in r]
            assert not missing, f"step {r['step']}: missing {missing}"
            assert r[f"{role}/optimizer_steps"] == 2.0, r[f"{role}/optimizer_steps"]
            assert r[f"{role}/lr"] == pytest.approx(LR)
            assert r[f"timing/update_{role}_s"] > 0.0
    assert any("actor/loss" in r for r in rows), "no step updated the actor"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_safe_rlhf_two_ranks_checkpoints_validates_and_exports(warm: Warm) -> None:
    assert warm.summary["steps"] == 2 and warm.summary["controller_bulk_bytes"] == 0
    rows = records(warm.run_dir)
    check_steps(rows, critic=True)
    assert "val/reward_mean" in rows[1] and "safe/lambda" in rows[1]
    ckpts = warm.run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert {p.name for p in (ckpts / "step_00000002").iterdir()} >= {"actor", "critic", "state.json"}
    assert (warm.run_dir / "hf" / "model.safetensors").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(FLOWS))
def test_flow_runs_two_steps_with_two_ranks(name: str, warm: Warm, tmp_path: Path) -> None:
    extra, critic = FLOWS[name]
    run_dir = tmp_path / name
    summary = controller("--flow", name, "--attach", str(warm.attach), "--run-dir", str(run_dir),
                         *sets(*COMMON, *extra, "export_hf=false"))
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    check_steps(records(run_dir), critic=critic)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_with_two_ranks(warm: Warm) -> None:
    """The checkpoint written by two actor and two critic ranks loads back into two ranks each."""
    summary = controller("--flow", "safe_rlhf", "--resume", str(warm.run_dir), "--attach", str(warm.attach),
                         *sets("steps=3", "val_every=0", "export_hf=false"))
    assert summary["steps"] == 3 and summary["resumed_from_step"] == 2
    rows = records(warm.run_dir)
    check_steps(rows, critic=True)
    assert len(rows) == 3
