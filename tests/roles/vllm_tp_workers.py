"""Rank body for vLLM at a generation TP (external_launcher): a TP-trained engine pushes its
weights into a vLLM engine spread over the same gloo world, which samples greedily. Not a test
module: spawned ranks import it by name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def write_model(folder: Path) -> Any:
    """A small Llama whose head_dim (64) vLLM's CPU attention supports (the tiny preset's 16 is
    not), with the tiny preset's tokenizer files; random weights, seed 0."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from hfrt.roles.models import resolve_model_dir

    src = Path(resolve_model_dir("tiny", 0))
    config = AutoConfig.from_pretrained(src)
    config.hidden_size, config.head_dim, config.num_attention_heads = 256, 64, 4
    config.num_key_value_heads, config.intermediate_size = 2, 256
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for f in src.iterdir():
        if "token" in f.name:
            shutil.copy(f, folder)
    return config


def vllm_tp(rank: int, world: int, *, out_dir: Path, model_dir: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.generation.hybrid import HybridEngine
    from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine
    from hfrt.roles.training.engines import EngineConfig, build_train_engine

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(1)  # other weights than the checkpoint vLLM starts from: the push must land
    engine: Any = build_train_engine(AutoModelForCausalLM.from_config(config), EngineConfig(backend="tp", tp=world, trainable=False))
    full = engine.full_parameters()
    vcfg = VLLMConfig(model_dir=model_dir, dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22,
                      max_num_seqs=4, tensor_parallel_size=world, data_parallel_size=1)  # fmt: skip
    gen = VLLMGenerationEngine(vcfg, pad_token_id=0)
    hybrid = HybridEngine(engine, gen)
    prompts = [[5, 17, 40, 9], [100, 3, 77]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, seed=3)
    out, metrics = hybrid.generate(prompts, params)
    gen.close()  # its /dev/shm segments: this process ends with os._exit, past atexit
    own = gen.model_parameters()
    embed = next(t for n, t in own.items() if n.endswith("embed_tokens.weight"))
    reference = AutoModelForCausalLM.from_config(config)
    reference.load_state_dict(full)
    ref = HFGenerationEngine(reference, pad_token_id=0, eos_token_id=None, share_weights=True).generate(prompts, params)
    mask = out["response_mask"].bool()
    return {
        "tokens_equal": torch.equal(out["responses"], ref["responses"]),
        "logprob_diff": float((out["log_probs"] - ref["log_probs"])[mask].abs().max()),
        # vLLM's vocabulary shard: the vocabulary padded to a multiple of 64, split over tp
        "embed_rows": int(embed.shape[0]),
        "vocab": int(config.vocab_size),
        "shapes": {n: tuple(t.shape) for n, t in own.items() if "layers.0." in n or "embed" in n},
        "pid": os.getpid(),
        "metrics": metrics,
    }
