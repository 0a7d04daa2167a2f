"""A GRPO run whose actor trains tensor parallel (tp=2 × dp=2 on 4 ranks) and generates at tp=1
(dp=4) through micro-DP resharding: it finishes, and every step reports the reshard's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_flows import run_flow

#: tiny preset, t2p1d2 → t1p1d4: every rank receives the other half of each split parameter
#: (fp32): the generation shard (the full model, 0.43 MB) less its own training piece.
EXPECTED_RECEIVED = 214016


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_with_tp_trained_actor_generating_at_tp1(tmp_path: Path) -> None:
    summary = run_flow(
        "grpo", tmp_path / "run", "steps=3", "roles.actor.world_size=4",
        "roles.actor.options.parallel.tp=2", "roles.actor.options.generation.parallel.tp=1",
    )  # fmt: skip
    assert summary["steps"] == 3 and summary["controller_bulk_bytes"] == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/loss" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["rollout/reshard/bytes_received"] == EXPECTED_RECEIVED, r
        assert r["rollout/reshard/bytes_sent"] == EXPECTED_RECEIVED, r
        assert r["rollout/timing/reshard_to_generate_s"] > 0 and r["rollout/memory/reshard_to_generate_peak_rss_mb"] > 0
