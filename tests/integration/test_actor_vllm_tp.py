"""A GRPO run whose actor trains at tp=2 on 2 ranks and samples with vLLM at tp=2 (each actor rank
one vLLM rank through external_launcher): it finishes, vLLM ran with the external launcher on
both ranks, and every step pushed weights, by micro-DP pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_flows import run_flow
from tests.roles.vllm_tp_workers import write_model
from tests.support import skip_without_vllm


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_with_a_tp2_actor_sampling_through_vllm_tp2(tmp_path: Path) -> None:
    skip_without_vllm("vLLM TP flow test", smollm2=False)
    model = tmp_path / "model"
    write_model(model)  # head_dim 64: vLLM's CPU attention does not take the tiny preset's 16
    summary = run_flow(
        "grpo", tmp_path / "run", "steps=2", "roles.actor.world_size=2", "roles.actor.options.parallel.tp=2",
        "roles.actor.options.generator=vllm", f"roles.actor.options.model={model}",
        f"roles.reference.options.model={model}", "roles.actor.options.vllm.max_model_len=128",
        "roles.actor.options.vllm.dtype=float32",
    )  # fmt: skip
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    for rank in (0, 1):
        log = (tmp_path / "run" / "logs" / f"actor-{rank}.log").read_text()
        assert "tensor_parallel_size=2" in log and "external launcher" in log.lower(), f"actor-{rank}: vLLM not at tp=2"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in records if "actor/loss" in r]
    assert len(stepped) == 2
    assert all(r["rollout/reshard/pushed_mb"] > 0 for r in stepped)
    # the push went by micro-DP pieces (roles/generation/vllm_pieces.py): equal layouts receive
    # nothing over the collectives; the vocabulary (259, padded per vLLM partition) goes whole
    assert all(r["rollout/reshard/bytes_received"] == 0 and r["rollout/reshard/whole_params"] == 2 for r in stepped)
