"""The hybrid engine: weights pushed before a rollout equal the trained weights, generation memory
is released afterwards, and every transition reports its time and peak memory."""

from __future__ import annotations

import torch

from hfrt.protocols.codec import Codec
from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
from hfrt.roles.generation.hybrid import HybridEngine, PeakRSS, Phase
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

from .dist_workers import make_batch, ppo_loss


def test_rollout_after_an_update_uses_the_updated_weights_and_frees_the_copy() -> None:
    tok = load_tokenizer("tiny")
    model = load_model(ModelConfig("tiny"))
    train = build_train_engine(model, EngineConfig(backend="local", optim=OptimConfig(lr=1e-2)))
    copy = load_model(ModelConfig("tiny"))
    gen = HFGenerationEngine(copy, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    gen.sleep()
    hybrid = HybridEngine(train, gen)
    train.step(ppo_loss, make_batch(model.config.vocab_size))

    seen: dict[str, torch.Tensor] = {}
    original_generate = gen.generate

    def spy(prompts, params):  # type: ignore[no-untyped-def]
        seen.update({k: v.detach().clone() for k, v in copy.named_parameters()})
        return original_generate(prompts, params)

    gen.generate = spy  # type: ignore[method-assign]
    out, metrics = hybrid.generate([tok("3+4=")["input_ids"]], SamplingParams(max_new_tokens=5, n=2, seed=0))
    for name, p in model.named_parameters():
        assert torch.equal(seen[name], p), name
    assert all(p.numel() == 0 for p in copy.parameters())  # released after the rollout
    for key in (
        "timing/reshard_to_generate_s",
        "timing/generate_s",
        "timing/reshard_to_train_s",
        "memory/peak_rss_mb",
        "memory/lifetime_peak_rss_mb",
    ):
        assert metrics[key] > 0, key
    assert metrics["reshard/pushed_mb"] == sum(p.numel() * 4 for p in model.parameters()) / 2**20
    recomputed = train.forward_logprobs(out)
    assert ((recomputed - out["log_probs"]) * out["response_mask"]).abs().max() < 1e-4
    assert hybrid.phase is Phase.TRAIN


def test_the_phase_crosses_the_wire_as_its_word() -> None:
    """The actor's hybrid_phase endpoint sends the phase: a plain "train" / "generate" on the wire."""
    codec = Codec()
    body, buffers = codec.encode({"phase": Phase.GENERATE})
    decoded = codec.decode(body, buffers)
    assert decoded == {"phase": "generate"} and type(decoded["phase"]) is str
    assert [p.value for p in Phase] == ["train", "generate"]


def test_shared_weights_need_no_push() -> None:
    tok = load_tokenizer("tiny")
    model = load_model(ModelConfig("tiny"))
    train = build_train_engine(model, EngineConfig(backend="local"))
    gen = HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, share_weights=True)
    out, metrics = HybridEngine(train, gen).generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))
    assert out["responses"].shape[0] == 1 and metrics["timing/reshard_to_generate_s"] >= 0
    assert all(p.numel() > 0 for p in model.parameters())


def test_peak_rss_sees_a_transient_allocation() -> None:
    with PeakRSS() as peak:
        start = peak.peak_mb
        block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
        del block
    assert peak.peak_mb - start > 128


def test_transition_figures_for_the_tiny_preset() -> None:
    from hfrt.bench.transition_measure import measure_transition

    figures = measure_transition("tiny", repeats=2)
    assert set(figures) == {
        "tiny_to_generate_s",
        "tiny_to_train_s",
        "tiny_weights_copy_s",
        "tiny_peak_rss_mb",
        "tiny_weights_mb",
    }
    assert all(value > 0 for value in figures.values())
