"""Tiny random configs of the model families hfrt trains with tensor / pipeline parallelism, built
locally (never from a hub): Llama, Qwen2, Qwen3, Mistral, Gemma3-text, Phi-3 (fused qkv_proj /
gate_up_proj) and Qwen3-MoE. Not a test module: spawned ranks import it by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe")


def config(family: str, *, layers: int = 4, tied: bool = False) -> Any:
    """A config with 4 heads (2 kv heads), hidden 64, vocabulary 128, `layers` decoder layers."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if family == "gemma3":
        kinds = ["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2)
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=8, layer_types=kinds)
    if family == "phi3":
        return tf.Phi3Config(**common)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, mlp_only_layers=[],
        )  # fmt: skip
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


def model(family: str, *, seed: int = 0, **kwargs: Any) -> nn.Module:
    """A causal LM of `config(family, ...)`, initialised from `seed` (the same on every rank)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config(family, **kwargs)).float()


def value_model(family: str, *, seed: int = 0, **kwargs: Any) -> nn.Module:
    """A critic: the family's decoder stack with hfrt's scalar value head, from `seed`."""
    from transformers import AutoModel

    from hfrt.roles.models import ValueModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = AutoModel.from_config(config(family, **kwargs)).float()
        return ValueModel(backbone, backbone.config.hidden_size)


def value_loss_fn(out: Any, mb: Any, scale: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """The critic's clipped value loss against the batch's `returns` (old values: zeros)."""
    from hfrt.roles.losses import value_loss

    returns = mb["advantages"]
    return value_loss(out.values, returns, torch.zeros_like(returns), mb["response_mask"], 0.5, "token-mean", scale)
