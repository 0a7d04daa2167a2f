"""The policy loss modes on real daemons: `hfrt controller --flow grpo` trains with GSPO, and with
CISPO under truncated importance sampling; bad loss options end the controller with exit 2 before
any daemon starts; hfrt.wire.loss_options imports no torch (the controller reads it)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_flows import run_flow


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grpo_trains_with_gspo_and_with_cispo_under_tis(tmp_path: Path) -> None:
    runs = {
        "gspo": ("policy_loss_mode=gspo", "loss_agg_mode=seq-mean-token-mean"),
        "cispo_tis": ("policy_loss_mode=cispo", "tis_cap=2", "actor_loss.clip_ratio_high=0.28"),
    }
    for name, sets in runs.items():
        summary = run_flow("grpo", tmp_path / name, "steps=2", "prompts_per_step=4", "n=4", *sets)
        assert summary["steps"] == 2
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1]
        for record in records:
            for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
                assert math.isfinite(record[key]), (name, key)
            assert record["actor/grad_norm"] > 0
            assert "actor/pg_clipfrac_lower" not in record  # vanilla's dual clip only: not the vanilla loss
            assert ("actor/tis_weight_mean" in record) == (name == "cispo_tis")
    # the sampler and the trainer share weights here: every TIS weight is about 1, none truncated
    last = [json.loads(line) for line in (tmp_path / "cispo_tis" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["actor/tis_weight_mean"] == pytest.approx(1.0, abs=0.05) and last["actor/tis_truncated_frac"] < 0.05


def test_controller_refuses_bad_loss_options_before_any_daemon_starts(tmp_path: Path) -> None:
    for item, wanted in (
        ("actor_loss.bogus=1", "unknown option(s) ['bogus']; accepted: "),
        ("policy_loss_mode=ppo", "use one of vanilla, gspo, cispo"),
        ("kl_loss_type=k9", "kl_loss_type='k9'"),
    ):
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(tmp_path / "r"), "--set", item],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert wanted in out.stderr and "ppo_mini_batch_size" in out.stderr and "micro_batch_size" in out.stderr
        assert time.monotonic() - start < 30 and not (tmp_path / "r").exists()  # no daemon, no run folder


def test_loss_options_import_no_torch() -> None:
    code = "import sys, hfrt.wire.loss_options, hfrt.flows.recipes.grpo, hfrt.flows.recipes.ppo; assert 'torch' not in sys.modules, 'torch'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
