"""The built-in generation engine: sampling options, layout, and sampler log-probs that the
training engine recomputes for the same tokens."""

from __future__ import annotations

import pytest
import torch

from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams, filter_logits
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
from hfrt.roles.training.engines import EngineConfig, build_train_engine


@pytest.fixture(scope="module")
def setup() -> tuple:
    tok = load_tokenizer("tiny")
    model = load_model(ModelConfig("tiny"))
    engine = build_train_engine(model, EngineConfig(backend="local", trainable=False))
    gen = HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, share_weights=True)
    prompts = [tok(t)["input_ids"] for t in ("1+1=", "the quick brown fox", "z")]
    return tok, engine, gen, prompts


def test_layout_and_n_samples(setup: tuple) -> None:
    tok, _, gen, prompts = setup
    out = gen.generate(prompts, SamplingParams(max_new_tokens=7, n=3, seed=0))
    rows = len(prompts) * 3
    assert out["responses"].shape == (rows, 7) and out["input_ids"].shape[0] == rows
    assert out["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert torch.equal(out["input_ids"][:, -7:], out["responses"])
    assert torch.equal(out["attention_mask"][:, -7:], out["response_mask"])
    assert torch.all(out["log_probs"] <= 0)


def test_stop_tokens_end_a_row_and_mask_the_rest(setup: tuple) -> None:
    _, _, gen, prompts = setup
    # top_k=1 is greedy: find the first token greedy decoding picks, then stop on it
    first = gen.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=1))["responses"][0, 0].item()
    out = gen.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(first,)))
    assert out["response_mask"].tolist() == [[1]]  # stopped after (and including) the stop token


def test_greedy_is_deterministic_and_top_k_one_is_greedy(setup: tuple) -> None:
    _, _, gen, prompts = setup
    greedy = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    again = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    topk1 = gen.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=5, ignore_eos=True, seed=4))
    assert torch.equal(greedy["responses"], again["responses"])
    assert torch.equal(greedy["responses"], topk1["responses"])


def test_filter_logits_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=1.0)).sum() == 3


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_training_engine_recomputes_the_sampler_log_probs(setup: tuple, temperature: float) -> None:
    _, engine, gen, prompts = setup
    out = gen.generate(prompts, SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=8, n=2, seed=1))
    recomputed = engine.forward_logprobs(out, temperature=temperature, micro_batch_size=4)
    diff = ((recomputed - out["log_probs"]) * out["response_mask"]).abs().max().item()
    assert diff < 1e-4


def test_sleep_frees_a_private_copy_and_wake_plus_push_restores_it() -> None:
    tok = load_tokenizer("tiny")
    source = load_model(ModelConfig("tiny"))
    copy = load_model(ModelConfig("tiny", seed=5))
    gen = HFGenerationEngine(copy, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    gen.sleep()
    assert all(p.numel() == 0 for p in copy.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        gen.generate([[5, 6]], SamplingParams())
    gen.wake()
    gen.load_weights(source.named_parameters())
    for (name, a), b in zip(source.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(a, b.cpu()), name
    with pytest.raises(KeyError, match="no parameter"):
        gen.load_weights([("not.a.weight", torch.zeros(1))])
