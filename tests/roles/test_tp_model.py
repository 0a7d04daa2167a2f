"""Tensor/pipeline-parallel tiny model and the TP × DP engine: 4 real ranks (spawned, gloo)
against the single-process model — logits, log-probs, a PPO step, greedy generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from .dist_workers import run_ranks
from .tp_workers import forward_layouts

LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def forwards(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(forward_layouts, 4, tmp_path_factory.mktemp("fwd"), layouts=LAYOUTS)


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_forward_equals_single_process(forwards: list[dict], tp: int, pp: int) -> None:
    results = [r[f"t{tp}p{pp}"] for r in forwards]
    for rank, res in enumerate(results):
        assert res["logits_diff"] < 1e-5, (rank, res["logits_diff"])
        assert res["logprob_diff"] < 1e-5, (rank, res["logprob_diff"])
    coords = [r["coords"] for r in results]  # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    dp = 4 // (tp * pp)
    assert all(((p * dp + d) * tp + t) == rank for rank, (t, p, d) in enumerate(coords))
    if tp == 4:  # 2 kv heads over 4 ranks: each rank holds one (replicated) kv head of 16 rows
        pieces = results[3]["pieces"]
        assert pieces["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
        assert pieces["model.layers.0.self_attn.q_proj.weight"] == (16, 64)
        assert pieces["model.embed_tokens.weight"] == (64, 64)  # 259 = 65 + 3 × 64
        assert results[0]["pieces"]["lm_head.weight"] == (65, 64)
    if pp == 2:  # stage 0 holds layer 0 and the embedding, stage 1 layer 1, norm and head
        first, last = results[0]["pieces"], results[-1]["pieces"]
        assert any(n.startswith("model.layers.0.") for n in first) and not any("layers.1." in n for n in first)
        assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last
