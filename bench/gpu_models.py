"""Random-weights models of real size for the one-call GPU check (bench/gpu/check.sh): Qwen3-0.6B's
and Qwen3-1.7B's published configurations written out here (no hub), and a folder builder that
makes a Hugging Face model folder from one on the spot (random weights, the byte tokenizer of the
tiny preset), plus a tiny model of the same architecture for the CPU run of the check.

It knows transformers' Qwen3 config fields; nothing of hfrt's roles or of what is measured.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

#: Qwen3's shared fields (Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B config.json)
_QWEN3: dict[str, Any] = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
    "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _QWEN3 | {"hidden_size": 1024, "intermediate_size": 3072},
    "qwen3-1.7b": _QWEN3 | {"hidden_size": 2048, "intermediate_size": 6144},
    # the CPU run's stand-in: the same architecture, a few MB
    "qwen3-tiny": _QWEN3 | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_window_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
                            "max_position_embeddings": 2048},
}


def parameter_count(name: str) -> int:
    """Parameters of CONFIGS[name] (tied head counted once), from the config alone."""
    c = CONFIGS[name]
    h, i, layers, v, d = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * d  # attention, MLP, two norms, q/k norms
    return v * h * (1 if c["tie_word_embeddings"] else 2) + layers * per_layer + h


def build_folder(name: str, target: Path, *, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0) -> dict[str, Any]:
    """A model folder at `target` with CONFIGS[name] and random weights made on `device` in
    `dtype` (a real-size model initialises in seconds on a GPU), the byte tokenizer (its pad, BOS
    and EOS ids are the config's); returns what was built and how long it took."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from hfrt.roles.models import build_byte_tokenizer, write_model_dir

    if name not in CONFIGS:
        raise ValueError(f"model {name!r}: expected one of {sorted(CONFIGS)}")
    start = time.perf_counter()
    tokenizer = build_byte_tokenizer()
    fields = {k: v for k, v in CONFIGS[name].items() if k not in ("model_type", "architectures")}
    config = Qwen3Config(**fields, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    target.mkdir(parents=True, exist_ok=True)
    write_model_dir(model.cpu(), tokenizer, target)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"model": name, "folder": str(target), "parameters": params, "dtype": dtype, "build_s": round(time.perf_counter() - start, 2)}
