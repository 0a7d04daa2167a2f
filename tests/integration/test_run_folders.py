"""Nothing fails silently with real `hfrt controller` runs: a reward function that raises on every
sample stops the run with its traceback; config.json holds every resolved setting, so `--config
RUN_DIR/config.json` runs the same run again; a folder that holds a run is refused without
--resume / --overwrite; a run on daemons an earlier run trained says so and can reset them.
(test_run_safety.py checks --overwrite and the errors caught before launch.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support import STARTED_PIDS

pytestmark = pytest.mark.timeout(300)

FAST = ["--set", "steps=2", "--set", "val_every=0", "--set", "prompts_per_step=8", "--set", "export_hf=false",
        "--set", "trace=false", "--set", "tensorboard=false"]


def hfrt(*args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=timeout)


def rewards(run_dir: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_reward_function_raising_on_every_sample_stops_the_run(tmp_path: Path) -> None:
    """A reward function `def score(response)` (one argument too few): every sample raises TypeError."""
    (tmp_path / "r.py").write_text("def score(response):\n    return 1.0\n")
    out = hfrt("controller", "--flow", "grpo", "--run-dir", str(tmp_path / "run"), *FAST,
               "--set", f"roles.reward.options.function={tmp_path / 'r.py'}:score")
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stdout == ""  # no summary of a run that trained on error scores
    err = out.stderr
    assert err.count("reward_function_error") == 1 and "kind=TypeError" in err, err  # once per kind
    assert "failed='64 of 64 samples'" in err
    assert ("hfrt controller: step 0: the reward function failed on 64 of 64 samples (100%), more than "
            "reward_error_limit=0.5 allows; the run stops") in err
    assert "Traceback (most recent call last):" in err and "TypeError: score() takes 1 positional argument" in err
    assert "hfrt/cli.py" not in err  # the reward function's traceback, not the controller's


@pytest.mark.slow
def test_config_json_reproduces_a_run_on_reset_weights_and_a_used_folder_is_refused(tmp_path: Path) -> None:
    """One set of warm daemons (a daemon start is most of a short run's time): the first run keeps
    them; a run attached to them says it starts from their trained weights; a run attached with
    `--config FIRST/config.json --set reset_weights=true` is the first run again (same rewards:
    the initial weights came back and config.json held every setting); a second run in the first
    run's folder is refused."""
    first = tmp_path / "first"
    out = hfrt("controller", "--flow", "grpo", "--keep-daemons", "--run-dir", str(first), *FAST, "--set", "seed=3")
    assert out.returncode == 0, out.stderr[-3000:]
    attach = json.loads(out.stdout)["attach"]
    address = json.loads(Path(attach).read_text())["address"]
    daemons = [p for p in psutil.process_iter(["cmdline"]) if address in " ".join(p.info["cmdline"] or [])]
    STARTED_PIDS.update(p.pid for p in daemons)
    try:
        assert "started_from_trained_weights" not in json.loads(out.stdout)
        assert (first / "initial_weights" / "roles.json").exists()  # kept before the first update
        saved = json.loads((first / "config.json").read_text())
        # every resolved setting, defaults included (GRPO's own and FlowConfig's), none of the run's own
        assert saved["flow"]["seed"] == 3 and saved["flow"]["n"] == 8 and saved["flow"]["kl_loss_coef"] == 0.001
        assert saved["flow"]["reward_error_limit"] == 0.5 and saved["flow"]["reset_weights"] is False
        assert not {"run_dir", "resume", "daemons_dir"} & set(saved["flow"])
        assert saved["roles"]["actor"]["options"]["model"] == "tiny"

        out = hfrt("controller", "--flow", "grpo", "--attach", attach, "--run-dir", str(tmp_path / "on"), *FAST)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout)["started_from_trained_weights"] == 2  # the first run's 2 steps
        assert "continuing_from_trained_weights" in out.stderr and "reset_weights=true" in out.stderr

        again = tmp_path / "again"
        out = hfrt("controller", "--flow", "grpo", "--attach", attach, "--run-dir", str(again),
                   "--config", str(first / "config.json"), "--set", "reset_weights=true", "--set", "checkpoint_every=2")
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads(out.stdout)
        assert summary["weights_reset"] == 4 and "started_from_trained_weights" not in summary
        engine = json.loads((again / "checkpoints" / "step_00000002" / "actor" / "hfrt_engine.json").read_text())
        assert engine["steps"] == 2  # counted from the initial weights again, not from 4
        changed = {"reset_weights": True, "checkpoint_every": 2}
        assert json.loads((again / "config.json").read_text()) == {**saved, "flow": {**saved["flow"], **changed}}
        assert rewards(again) == rewards(first)  # the same run: same weights, seeds, samples, rewards

        before = (first / "metrics.jsonl").read_text()
        out = hfrt("controller", "--flow", "grpo", "--run-dir", str(first), "--set", "steps=5")
        assert out.returncode == 2, out.stderr
        assert (f"hfrt controller: run folder {first} already holds a run (config.json, metrics.jsonl); "
                f"continue it with --resume {first}, replace it with --overwrite") in out.stderr
        assert (first / "metrics.jsonl").read_text() == before  # nothing appended, nothing overwritten
        assert hfrt("stop", attach).returncode == 0
    finally:
        for process in daemons:
            if process.is_running():
                os.kill(process.pid, signal.SIGKILL)
