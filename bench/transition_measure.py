"""Measuring the actor's train → generate → train transition for one preset, beside the time of a
plain in-process copy of the same weights (the floor any weight push is compared with).

Builds its own engines in this process; knows nothing of the CLI, daemons or the wire
(bench/transition.py runs `measure_transition` in a child process and prints the figures).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hfrt.roles.generation.hf import GenerationEngine, HFGenerationEngine
from hfrt.roles.generation.hybrid import HybridEngine, PeakRSS
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer, resolve_model_dir
from hfrt.roles.training.engines import EngineConfig, build_train_engine


def metric_prefix(preset: str) -> str:
    """'smollm2-135m' → 'smollm2_135m' (figures are named like tiny_to_generate_s)."""
    return preset.replace("-", "_").replace(".", "_")


def plain_copy_seconds(model: torch.nn.Module, repeats: int = 3) -> float:
    """Median time to copy every parameter into preallocated tensors of the same shape."""
    sources = [p.detach() for p in model.parameters()]
    targets = [torch.empty_like(s) for s in sources]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for dst, src in zip(targets, sources, strict=True):
            dst.copy_(src)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _generation_engine(preset: str, engine: str, tokenizer: Any) -> GenerationEngine:
    if engine == "vllm":
        from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine

        config = VLLMConfig(
            str(resolve_model_dir(preset)), dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20
        )
        return VLLMGenerationEngine(config, pad_token_id=tokenizer.pad_token_id)
    if engine != "hf":
        raise ValueError(f"unknown generation engine {engine!r}: use hf or vllm")
    return HFGenerationEngine(
        load_model(ModelConfig(preset)), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )


def measure_transition(preset: str, *, engine: str = "hf", repeats: int = 3) -> dict[str, float]:
    """Median to-generate / to-train seconds over `repeats` round trips, the peak RSS seen during
    them, and the plain-copy time, keyed `<prefix>_to_generate_s` etc. (see metric_prefix)."""
    tokenizer = load_tokenizer(preset)
    model = load_model(ModelConfig(preset))
    train = build_train_engine(model, EngineConfig(backend="local", trainable=False))
    gen = _generation_engine(preset, engine, tokenizer)
    gen.sleep()
    hybrid = HybridEngine(train, gen)
    to_generate, to_train = [], []
    with PeakRSS() as peak:
        for _ in range(repeats):
            to_generate.append(hybrid.to_generate()["timing/reshard_to_generate_s"])
            to_train.append(hybrid.to_train()["timing/reshard_to_train_s"])
    prefix = metric_prefix(preset)
    return {
        f"{prefix}_to_generate_s": statistics.median(to_generate),
        f"{prefix}_to_train_s": statistics.median(to_train),
        f"{prefix}_weights_copy_s": plain_copy_seconds(model, repeats),
        f"{prefix}_peak_rss_mb": peak.peak_mb,
        f"{prefix}_weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
    }
