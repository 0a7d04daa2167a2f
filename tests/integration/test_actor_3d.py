"""GRPO runs whose actor trains tensor parallel on 4 ranks and generates at another tp through
micro-DP resharding (t2p1d2 → t1p1d4; t4p1d1 → t2p1d2, sampling in strided generation TP groups):
they finish, and every step reports the reshard's bytes; and one generating over two pipeline
stages (t1p1d4 → t1p2d2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_flows import run_flow

#: tiny preset, fp32: a rank receives its generation shard less its own training rows
#: (t2p1d2 → t1p1d4: the other half of the model; t4p1d1 → t2p1d2: its micro-DP partner's quarter).
CASES = [(2, 1, 3, 214016), (4, 2, 2, 98816)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,tp_g,steps,received", CASES, ids=["t2-to-t1", "t4-to-t2"])
def test_grpo_with_tp_trained_actor_generating_at_its_own_tp(
    tmp_path: Path, tp: int, tp_g: int, steps: int, received: int
) -> None:
    summary = run_flow(
        "grpo", tmp_path / "run", f"steps={steps}", "roles.actor.world_size=4",
        f"roles.actor.options.parallel.tp={tp}", f"roles.actor.options.generation.parallel.tp={tp_g}",
    )  # fmt: skip
    assert summary["steps"] == steps and summary["controller_bulk_bytes"] == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in records if "actor/loss" in r]
    assert len(stepped) == steps
    for r in stepped:
        assert r["rollout/reshard/bytes_received"] == received, r
        assert r["rollout/reshard/bytes_sent"] == received, r
        assert r["rollout/timing/reshard_to_generate_s"] > 0 and r["rollout/memory/reshard_to_generate_peak_rss_mb"] > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_with_an_actor_generating_over_two_pipeline_stages(tmp_path: Path) -> None:
    """t1p1d4 → t1p2d2: each rank keeps its stage's layers of its dp-gathered pieces (no bytes
    exchanged, every generation tensor kept from the training pieces) and samples with a KV cache
    on both stages."""
    summary = run_flow(
        "grpo", tmp_path / "run", "steps=2", "roles.actor.world_size=4",
        "roles.actor.options.parallel.tp=1", "roles.actor.options.generation.parallel.pp=2",
    )  # fmt: skip
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in records if "actor/loss" in r]
    assert len(stepped) == 2
    for r in stepped:
        assert r["rollout/reshard/bytes_received"] == 0 and r["rollout/reshard/built"] == 0, r
        assert r["rollout/reshard/shared"] > 0 and r["response_length/mean"] > 0, r
