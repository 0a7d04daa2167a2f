"""GRPO runs whose actor trains tensor (and pipeline) parallel on 4 ranks and generates at its own
tp with one pipeline stage through micro-DP resharding: the tiny Llama preset at t2p1d2 → t1p1d4;
a tiny random Qwen3 (built here, saved to a local folder, 4 kv heads) at t4p1d1 → t2p1d2 (sampling
in strided generation TP groups) and at t2p2d1 → t2p1d2 (a training pipeline merged into one
generation stage), and a 4-layer one at t2p2d1 under the interleaved 1F1B schedule (two stages
per pipeline rank) with loss_parallel and sequence parallelism → t2p1d2. They finish, and every step reports the reshard's
bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_flows import run_flow

#: fp32 bytes a rank receives: its generation shard less its own training rows. Only the q/k/v/o
#: and gate/up/down weights are split (the 259-row vocabulary is not divisible by 2 or 4, so the
#: embedding and head stay whole): tiny Llama 2 × 36864 of them, half received at t2 → t1;
#: tiny Qwen3 2 × 40960, a quarter received at t4 → t2.
CASES = [("tiny", 2, 1, 1, 2 * 36864 // 2 * 4), ("qwen3", 4, 1, 2, 2 * 40960 // 4 * 4), ("qwen3", 2, 2, 2, None)]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _qwen3(tmp_path_factory, layers=2)


def _qwen3(tmp_path_factory: pytest.TempPathFactory, layers: int, spare_rows: int = 0) -> Path:
    """A tiny random Qwen3 with the tiny preset's tokenizer, saved as a Hugging Face folder
    (`spare_rows` unused vocabulary rows beyond the tokenizer's 259)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from hfrt.roles.models import TINY_CHAT_TEMPLATE, build_byte_tokenizer

    out = tmp_path_factory.mktemp(f"qwen3-{layers}")
    tok = build_byte_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    config = Qwen3Config(
        vocab_size=len(tok) + spare_rows, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,tp,pp,tp_g,received", CASES, ids=["llama-t2p1d2-to-t1p1d4", "qwen3-t4p1d1-to-t2p1d2", "qwen3-t2p2d1-to-t2p1d2"])
def test_grpo_with_a_parallel_actor_generating_at_its_own_tp(
    tmp_path: Path, qwen3_dir: Path, model: str, tp: int, pp: int, tp_g: int, received: int | None
) -> None:
    path = "tiny" if model == "tiny" else str(qwen3_dir)
    summary = run_flow(
        "grpo", tmp_path / "run", "steps=2", "roles.actor.world_size=4",
        f"roles.actor.options.model={path}", f"roles.reference.options.model={path}",
        f"roles.actor.options.parallel.tp={tp}", f"roles.actor.options.parallel.pp={pp}",
        f"roles.actor.options.generation.parallel.tp={tp_g}",
    )  # fmt: skip
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in records if "actor/loss" in r]
    assert len(stepped) == 2
    for r in stepped:
        if received is not None:
            assert r["rollout/reshard/bytes_received"] == received, r
            assert r["rollout/reshard/bytes_sent"] == received, r
        else:  # t2p2d1 → t2p1d2: each rank receives the other stage's layers (and embedding or head)
            assert r["rollout/reshard/bytes_received"] > 0 and r["rollout/reshard/shared"] > 0, r
        assert r["rollout/timing/reshard_to_generate_s"] > 0 and r["rollout/memory/reshard_to_generate_peak_rss_mb"] > 0
        assert r["response_length/mean"] > 0, r


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_with_an_interleaved_pipeline_and_loss_parallel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """t2p2d1 with 2 stages per pipeline rank (layers 0, 2 on one, 1, 3 on the other),
    vocabulary-parallel log-probs and sequence parallelism, generating at t2p1d2: the engine settings reach the actor's
    engine and its reshard (a wrong stage rule stops the transition: a rank lacks a piece)."""
    path = str(_qwen3(tmp_path_factory, layers=4, spare_rows=1))  # 260 rows: tp=2 divides them
    summary = run_flow(
        "grpo", tmp_path / "run", "steps=2", "roles.actor.world_size=4",
        f"roles.actor.options.model={path}", f"roles.reference.options.model={path}",
        "roles.actor.options.parallel.tp=2", "roles.actor.options.parallel.pp=2",
        "roles.actor.options.engine.pp_schedule=interleaved-1f1b", "roles.actor.options.engine.loss_parallel=true",
        "roles.actor.options.engine.sequence_parallel=true", "roles.actor.options.generation.parallel.tp=2",
    )  # fmt: skip
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in records if "actor/loss" in r]
    assert len(stepped) == 2
    for r in stepped:
        assert r["rollout/reshard/bytes_received"] > 0 and r["response_length/mean"] > 0, r
