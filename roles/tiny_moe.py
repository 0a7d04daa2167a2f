"""The `tiny-moe` preset: the tiny preset's byte tokenizer and chat template on a 2-layer random
Qwen3-MoE (hidden 64, 4 experts, 2 per token), for routing replay's tests and figures. It knows
how the preset is built; where presets are cached and resolved is roles/models.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save(target: Path, seed: int) -> None:
    """Write the preset's model folder (weights drawn from `seed`, the same on every rank)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from hfrt.roles.models import TINY_CHAT_TEMPLATE, build_byte_tokenizer, write_model_dir

    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a config attribute the stubs do not list
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    write_model_dir(model, tokenizer, target)
