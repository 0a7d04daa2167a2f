"""The vLLM generation engine on CPU with smollm2-135m: rollouts, sampler log-probs that the
training engine recomputes, and weights pushed in-process after an update."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import skip_without_vllm

from .dist_workers import run_alone, vllm_rollouts


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_vllm_rollout_push_and_log_probs(tmp_path: Path) -> None:
    skip_without_vllm("vLLM test")
    result = run_alone(vllm_rollouts, tmp_path)
    print({k: v for k, v in result.items() if k != "ok"})
    assert result["text"].strip()
    assert result["diff_before"] < 2e-3  # vLLM's fp32 CPU kernels vs transformers
    assert result["diff_after"] < 2e-3  # the pushed weights are the trained ones
    assert result["moved"] > 1e-3  # ... and the update did change the policy
    for key in ("timing/reshard_to_generate_s", "timing/reshard_to_train_s", "memory/peak_rss_mb"):
        assert result["metrics"][key] > 0, key
