"""The engines on a CUDA device (NCCL process group, device placement, bf16); skipped without one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
from hfrt.roles.generation.hybrid import HybridEngine
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

from .dist_workers import make_batch, ppo_loss, run_ranks, train_and_push
from .test_engines import reference_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_local_engine_step_and_rollout_on_cuda(precision: str) -> None:
    tok = load_tokenizer("tiny")
    model = load_model(ModelConfig("tiny"))
    train = build_train_engine(
        model, EngineConfig(backend="local", mixed_precision=precision, optim=OptimConfig(lr=1e-2))
    )
    assert next(model.parameters()).is_cuda
    metrics = train.step(ppo_loss, make_batch(model.config.vocab_size), micro_batch_size=2)
    assert metrics["loss"] == metrics["loss"] and metrics["grad_norm"] > 0
    gen = HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, share_weights=True)
    out, timings = HybridEngine(train, gen).generate([tok("2+2=")["input_ids"]], SamplingParams(max_new_tokens=6, n=2))
    assert "memory/cuda_max_allocated_mb" in timings
    if precision == "fp32":
        recomputed = train.forward_logprobs(out)
        assert ((recomputed - out["log_probs"]) * out["response_mask"]).abs().max() < 1e-3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_sharded_engines_on_one_gpu_match_the_cpu_reference(tmp_path: Path, backend: str) -> None:
    if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    ref_metrics, ref_params = reference_step()
    (result,) = run_ranks(train_and_push, 1, tmp_path, backend=backend, zero_stage=3, check_checkpoint=True)
    assert result["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-4)
    assert result["exact"] and result["logprob_diff"] < 1e-3
    for name, value in ref_params.items():
        assert torch.allclose(result["pushed"][name].cpu(), value.cpu(), atol=1e-3), name
    assert result["after_load"]["loss"] == pytest.approx(result["after_save"]["loss"], abs=1e-6)
