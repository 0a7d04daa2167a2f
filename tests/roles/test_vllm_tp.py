"""vLLM at a generation TP: two gloo ranks of a TP=2 training engine are one vLLM TP=2 engine
(external_launcher, in-process); after the push each rank holds half of every TP-split weight
and greedy sampling matches a single-process transformers reference on the trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrt.roles.generation.vllm_engine import CPUSHM_GLOB, SHM_DIR, _held
from tests.roles.dist_workers import run_ranks
from tests.roles.vllm_tp_workers import vllm_tp, write_model
from tests.support import skip_without_vllm


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_vllm_external_launcher_tp2_samples_the_pushed_weights(tmp_path: Path) -> None:
    skip_without_vllm("vLLM TP test", smollm2=False)
    model_dir = tmp_path / "model"
    write_model(model_dir)
    before = set(SHM_DIR.glob(CPUSHM_GLOB))
    results = run_ranks(vllm_tp, 2, tmp_path, model_dir=str(model_dir))
    left = set(SHM_DIR.glob(CPUSHM_GLOB)) - before
    assert not left - _held(sorted(left)), f"the engines left vLLM shared-memory segments: {sorted(left)}"
    for rank, res in enumerate(results):
        print(rank, {k: v for k, v in res.items() if k != "metrics"})
        padded = -(-res["vocab"] // 64) * 64
        assert res["embed_rows"] == padded // 2, f"rank {rank}: vLLM's embedding is not a TP half: {res['shapes']}"
        assert res["tokens_equal"], f"rank {rank}: greedy tokens differ from transformers on the pushed weights"
        assert res["logprob_diff"] < 2e-3, f"rank {rank}: {res['logprob_diff']}"
        assert res["metrics"]["timing/reshard_to_generate_s"] > 0
