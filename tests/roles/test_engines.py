"""Training engines: the local engine, LR schedules, and FSDP2 / DeepSpeed ZeRO with 2 real
ranks (spawned processes, gloo) against a single-process reference step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hfrt.roles.models import ModelConfig, load_model
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.engines.base import lr_multiplier

from .dist_workers import make_batch, ppo_loss, run_ranks, train_and_push


def reference_step() -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step on the whole 8-row batch in one process: the figures 2 ranks must reproduce."""
    model = load_model(ModelConfig("tiny"))
    engine = build_train_engine(model, EngineConfig(backend="local", micro_batch_size=2, optim=OptimConfig(lr=1e-2)))
    metrics = engine.step(ppo_loss, make_batch(model.config.vocab_size), micro_batch_size=2)
    return metrics, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    return reference_step()


def test_micro_batch_size_does_not_change_the_step() -> None:
    results = []
    for micro in (1, 8):
        model = load_model(ModelConfig("tiny"))
        engine = build_train_engine(model, EngineConfig(backend="local", optim=OptimConfig(lr=1e-2)))
        metrics = engine.step(ppo_loss, make_batch(model.config.vocab_size), micro_batch_size=micro)
        results.append((metrics, {n: p.grad for n, p in model.named_parameters()}))
    (m1, g1), (m8, g8) = results
    assert m1["loss"] == pytest.approx(m8["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-5)
    for name in g1:  # accumulated gradients (kept after the step) agree
        assert torch.allclose(g1[name], g8[name], atol=1e-6), name


def test_grad_clip_and_lr_schedules() -> None:
    warm_cos = lr_multiplier(OptimConfig(schedule="warmup_cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1))
    assert [round(warm_cos(s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
    assert lr_multiplier(OptimConfig(warmup_steps=4))(1) == 0.5
    model = load_model(ModelConfig("tiny"))
    engine = build_train_engine(
        model, EngineConfig(backend="local", optim=OptimConfig(lr=1e-3, grad_clip=0.01, warmup_steps=2))
    )
    metrics = engine.step(ppo_loss, make_batch(model.config.vocab_size))
    assert metrics["lr"] == pytest.approx(1e-3)  # after the first of 2 warmup steps the LR is 1.0 × lr
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert metrics["grad_norm"] > 0.01 and clipped.item() == pytest.approx(0.01, rel=1e-3)


def test_local_checkpoint_round_trip(tmp_path: Path) -> None:
    model = load_model(ModelConfig("tiny"))
    engine = build_train_engine(model, EngineConfig(backend="local", optim=OptimConfig(lr=1e-2)))
    batch = make_batch(model.config.vocab_size)
    engine.step(ppo_loss, batch)
    path = engine.save(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging folder left behind
    after = engine.step(ppo_loss, batch)
    engine.load(path)
    assert engine.step(ppo_loss, batch)["loss"] == pytest.approx(after["loss"], abs=1e-7)
    with pytest.raises(FileNotFoundError, match="not an hfrt engine checkpoint"):
        engine.load(tmp_path)


def test_unknown_backend_and_frozen_engine() -> None:
    model = load_model(ModelConfig("tiny"))
    with pytest.raises(ValueError, match="unknown training backend 'megatron'"):
        build_train_engine(model, EngineConfig(backend="megatron"))
    frozen = build_train_engine(model, EngineConfig(backend="local", trainable=False))
    with pytest.raises(RuntimeError, match="trainable=False"):
        frozen.step(ppo_loss, make_batch(model.config.vocab_size))


def test_value_engine_forward() -> None:
    model = load_model(ModelConfig("tiny", value_head=True))
    engine = build_train_engine(model, EngineConfig(backend="local", trainable=False))
    batch = make_batch(model.backbone.config.vocab_size)
    values = engine.forward_values(batch, micro_batch_size=3)
    assert values.shape == batch["responses"].shape
    with pytest.raises(TypeError, match="value model"):
        engine.forward_logprobs(batch)


def _check_two_ranks(results: list[dict], reference: tuple[dict[str, float], dict[str, torch.Tensor]]) -> None:
    ref_metrics, ref_params = reference
    for res in results:
        assert res["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
        assert res["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert res["exact"], "weights pushed to the generation engine differ from the trained weights"
        assert res["logprob_diff"] < 1e-4
        assert res["transition"]["timing/reshard_to_generate_s"] > 0
        assert res["transition"]["timing/reshard_to_train_s"] > 0
    assert results[0]["checksum"] == results[1]["checksum"]  # both ranks pushed the same weights
    pushed = results[0]["pushed"]
    assert sorted(pushed) == sorted(ref_params)
    for name, value in ref_params.items():
        assert torch.allclose(pushed[name], value, atol=2e-5), name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp2_two_ranks_match_one_process(tmp_path: Path, reference: tuple) -> None:
    results = run_ranks(train_and_push, 2, tmp_path, backend="fsdp2", check_checkpoint=True)
    _check_two_ranks(results, reference)
    for res in results:
        assert res["after_load"]["loss"] == pytest.approx(res["after_save"]["loss"], abs=1e-7)


needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_two_ranks_match_one_process(tmp_path: Path, reference: tuple, stage: int) -> None:
    results = run_ranks(train_and_push, 2, tmp_path, backend="deepspeed", zero_stage=stage, check_checkpoint=stage == 3)
    _check_two_ranks(results, reference)
    if stage == 3:
        for res in results:
            assert res["after_load"]["loss"] == pytest.approx(res["after_save"]["loss"], abs=1e-7)


def test_critic_step_fits_returns() -> None:
    from hfrt.roles.losses import value_loss

    model = load_model(ModelConfig("tiny", value_head=True))
    engine = build_train_engine(model, EngineConfig(backend="local", optim=OptimConfig(lr=3e-3)))
    batch = make_batch(model.backbone.config.vocab_size)
    batch["returns"] = torch.ones_like(batch["advantages"])
    batch["old_values"] = engine.forward_values(batch)

    def critic_loss(out, mb, scale):  # type: ignore[no-untyped-def]
        return value_loss(out.values, mb["returns"], mb["old_values"], mb["response_mask"], 10.0, scale=scale)

    losses = [engine.step(critic_loss, batch, micro_batch_size=4)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]


def test_adamw_is_fused_over_plain_tensors_and_steps_as_the_per_tensor_loop() -> None:
    """Plain parameters get the fused AdamW kernel (what transformers' Trainer uses), and its step
    equals the per-tensor loop's to float rounding."""
    from hfrt.roles.training.engines.optim import adamw_kernel, build_optimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    assert adamw_kernel(params) == {"fused": True}
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = build_optimizer(params, OptimConfig(lr=1e-2, weight_decay=0.1))
    loop = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        loop.step()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert not torch.equal(p, torch.zeros_like(p))
