"""The hostile test's case, with real daemons: the newest checkpoint's actor weights cut to half
(`actor/local.pt`) no longer end the resumed run with a load error inside the actor daemon; the
checksum check before launch names the file and the run resumes from the previous checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_truncated_actor_weights_fall_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    quiet = ["--set", "export_hf=false", "--set", "trace=false", "--set", "tensorboard=false", "--set", "val_every=0"]
    first = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--run-dir", str(run_dir), "--set", "steps=2",
         "--set", "checkpoint_every=1", *quiet], capture_output=True, text=True, timeout=300,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    newest = run_dir / "checkpoints" / "step_00000002"
    weights = newest / "actor" / "local.pt"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--resume", str(run_dir), "--set", "steps=3", *quiet],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"hfrt controller: warning: checkpoint {newest}: actor/local.pt is {len(data) // 2} bytes, it was "
            f"{len(data)} when saved (truncated?); passed over") in out.stderr
    assert json.loads(out.stdout)["resumed_from_step"] == 1
