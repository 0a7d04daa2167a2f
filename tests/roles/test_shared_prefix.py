"""Shared-prefix forwards (roles/training/engines/shared_prefix.py): which rows share what, and
exactness — log-probs, entropies, loss and gradients equal to the unshared pass at 1e-5, on the
local engine (the tiny Llama; Qwen3 with LoRA; split groups, a token budget, shared system prompts,
multi-turn rows) and on two real gloo ranks (FSDP2, DeepSpeed ZeRO-3, TP); fallbacks where a model
keeps no whole prefix in its cache; the tokens each step reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.roles.models import ModelConfig, load_model
from hfrt.roles.training import batching
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.engines import shared_prefix as sp

from . import model_zoo
from .dist_workers import run_ranks
from .shared_prefix_workers import R, grouped_batch, rows_batch, run_both, sharded_rank

TOL = 1e-5


def assert_equal(
    results: dict[bool, Any], mask: torch.Tensor, what: str, grads: bool = True, fewer: float = 0.6
) -> None:
    """The shared pass's outputs, loss and gradients equal the unshared ones'; it computed fewer tokens."""
    (lp, ent, metrics, g), (slp, sent, smetrics, sg) = results[False], results[True]
    assert float((lp - slp)[mask].abs().max()) < TOL, what
    assert float((ent - sent)[mask].abs().max()) < TOL, what
    assert abs(metrics["loss"] - smetrics["loss"]) < TOL, what
    assert abs(metrics["grad_norm"] - smetrics["grad_norm"]) < TOL * max(1.0, metrics["grad_norm"]), what
    if grads:
        worst = max(float((g[k] - sg[k]).abs().max()) for k in g)
        assert worst < TOL, (what, worst)
    assert smetrics["tokens_in_batch"] == metrics["tokens_in_batch"], what
    assert smetrics["tokens_computed"] < fewer * metrics["tokens_computed"], (what, smetrics, metrics)


def local(model: torch.nn.Module, **settings: Any) -> Any:
    return lambda shared: build_train_engine(
        model, EngineConfig(optim=OptimConfig(lr=0.0), shared_prefix=shared, **({"micro_batch_size": 8} | settings))
    )


def test_rows_sharing_a_prompt_run_it_once() -> None:
    batch = grouped_batch(128)  # prompts of 60 and 45 tokens, 4 rows each
    lengths = batching.row_lengths(batch)
    micro = sp.micro(batch, range(8), lengths, 32)
    assert micro is not None
    assert micro.inputs[sp.PREFIX_IDS].shape == (2, 59)  # each prompt once, less its last token
    assert micro.inputs[sp.OWNER].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert micro.inputs["position_ids"][:, 0].tolist() == [59] * 4 + [44] * 4  # continuing after each prefix
    assert sp.computed_tokens(micro) < 0.4 * 8 * (60 + R)
    assert sp.micro(batch, range(8), lengths, 64) is None  # no group shares 64 tokens
    assert sp.micro(batch, [0], lengths, 32) is None  # one row shares nothing


def test_prompts_under_one_system_prompt_share_it() -> None:
    batch = grouped_batch(128, prompts=(70, 60, 50, 40), n=1, system=36)  # 4 different prompts, one head
    micro = sp.micro(batch, range(4), batching.row_lengths(batch), 32)
    assert micro is not None and micro.inputs[sp.PREFIX_IDS].shape == (1, 36)


def test_exact_with_split_groups_a_budget_system_prompts_and_multi_turn_rows() -> None:
    model = load_model(ModelConfig("tiny"))
    vocab = model.config.vocab_size
    batch = grouped_batch(vocab, prompts=(70, 50), system=40)
    mask = batch["response_mask"].bool()
    assert_equal(run_both(local(model, micro_batch_size=3), batch), mask, "groups split over micro-batches")
    assert_equal(run_both(local(model, max_tokens_per_micro_batch=400), batch), mask, "token budget")
    g = torch.Generator().manual_seed(1)  # a conversation's turns: each row's prompt extends the last
    talk = torch.randint(3, vocab, (90,), generator=g)
    rows = [
        (talk[:cut], torch.randint(3, vocab, (int(torch.randint(1, R + 1, (1,), generator=g)),), generator=g))
        for cut in (40, 55, 70, 90)
    ]
    turns = rows_batch(rows, 90, g)
    micro = sp.micro(turns, range(4), batching.row_lengths(turns), 32)
    assert micro is not None and micro.inputs[sp.PREFIX_IDS].shape == (1, 39)  # the first turn's prompt
    assert_equal(run_both(local(model), turns), turns["response_mask"].bool(), "multi-turn rows", fewer=0.75)


def test_qwen3_with_lora_is_exact() -> None:
    from hfrt.roles.training.lora import LoraSpec

    batch = grouped_batch(128)

    def engine_of(shared: bool) -> Any:
        config = EngineConfig(optim=OptimConfig(lr=0.0), micro_batch_size=8, shared_prefix=shared)
        return build_train_engine(model_zoo.model("qwen3", layers=2), config, LoraSpec(rank=4, alpha=8.0))

    assert_equal(run_both(engine_of, batch), batch["response_mask"].bool(), "qwen3 with lora")


def test_off_and_fallbacks_give_plain_micro_batches() -> None:
    batch = grouped_batch(128)
    off = build_train_engine(model_zoo.model("llama", layers=2), EngineConfig(trainable=False, shared_prefix=False))
    assert all(sp.PREFIX_IDS not in m.inputs for m in off.micro_batches(batch))
    assert off.sharing.reason == "engine.shared_prefix = false"
    gemma = build_train_engine(model_zoo.model("gemma3", layers=2), EngineConfig(trainable=False, micro_batch_size=8))
    assert all(sp.PREFIX_IDS not in m.inputs for m in gemma.micro_batches(batch))
    assert "sliding" in str(gemma.sharing.reason)
    critic = build_train_engine(model_zoo.value_model("llama", layers=2), EngineConfig(trainable=False))
    critic.micro_batches(batch)
    assert "value model" in str(critic.sharing.reason)
    packed = build_train_engine(model_zoo.model("llama", layers=2), EngineConfig(trainable=False, pack=True))
    assert all(batching.PACKED_POSITIONS in m.inputs for m in packed.micro_batches(batch))


@pytest.mark.parametrize(
    "bad", [{"shared_prefix": "yes"}, {"shared_prefix_min_tokens": 0}, {"shared_prefix_min_tokens": 2.5}]
)
def test_bad_settings_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="engine.shared_prefix"):
        EngineConfig(**bad)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_deepspeed_and_tp_ranks_are_exact(tmp_path: Path) -> None:
    results = run_ranks(sharded_rank, 2, tmp_path)
    batch = grouped_batch(load_model(ModelConfig("tiny")).config.vocab_size)
    mask = batch["response_mask"].bool()
    for rank, res in enumerate(results):
        mine = mask[rank * 4 : rank * 4 + 4]
        assert_equal(res["fsdp2"], mine, f"fsdp2 rank {rank}")
        assert_equal(res["tp"], mask, f"tp rank {rank}")
        assert_equal(res["tp_loss_parallel"], mask, f"tp loss_parallel rank {rank}")
        if importlib.util.find_spec("deepspeed") is not None:
            assert_equal(res["deepspeed"], mine, f"deepspeed zero-3 rank {rank}", grads=False)
    assert results[0]["fsdp2"][True][2]["tokens_in_batch"] == 469.0  # summed over both ranks' rows


def test_a_padding_row_keeps_only_its_own_micro_batch_unshared() -> None:
    batch = grouped_batch(128)
    batch = {k: torch.cat([v, torch.zeros_like(v[:1])]) for k, v in batch.items()}  # equal-rows padding: no tokens
    engine = build_train_engine(model_zoo.model("llama", layers=2), EngineConfig(trainable=False, micro_batch_size=8))
    first, second = engine.micro_batches(batch)
    assert sp.PREFIX_IDS in first.inputs and sp.PREFIX_IDS not in second.inputs
