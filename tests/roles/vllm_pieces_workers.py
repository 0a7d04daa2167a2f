"""Rank body for vLLM fed micro-DP pieces (roles/generation/vllm_pieces.py): a TP-trained engine
pushes into a vLLM engine at the same tp over the same gloo world, first by pieces, then the full
weights as before; what vLLM's layers received, its tokens and log-probs are recorded after each.
Not a test module: spawned ranks import it by name."""

from __future__ import annotations

from typing import Any

import torch


def record_linear_weights() -> dict[str, torch.Tensor]:
    """Patch vLLM's CPU GEMM dispatch (it runs after every layer's load, then packs the weight
    away into a kernel handle) to keep a copy of each linear layer's loaded, fused per-rank weight,
    by layer prefix: what the loaders built, before packing."""
    import vllm.model_executor.layers.utils as utils

    seen: dict[str, torch.Tensor] = {}
    original = utils.dispatch_cpu_unquantized_gemm

    def recording(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.is_meta and weight.numel():
            seen[str(getattr(layer, "prefix", id(layer)))] = weight.detach().clone()
        original(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = recording
    return seen


def vllm_pieces(rank: int, world: int, *, out_dir: Any, model_dir: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfrt.roles.generation.hf import SamplingParams
    from hfrt.roles.generation.hybrid import HybridEngine, compare_weights
    from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine
    from hfrt.roles.generation.vllm_pieces import piece_hybrid
    from hfrt.roles.training.engines import EngineConfig, build_train_engine
    from hfrt.roles.training.parallel.layout import Layout

    seen = record_linear_weights()
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(1)  # other weights than the checkpoint vLLM starts from: the push must land
    engine: Any = build_train_engine(AutoModelForCausalLM.from_config(config), EngineConfig(backend="tp", tp=world, trainable=False))
    vcfg = VLLMConfig(model_dir=model_dir, dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22,
                      max_num_seqs=4, tensor_parallel_size=world, data_parallel_size=1)  # fmt: skip
    gen = VLLMGenerationEngine(vcfg, pad_token_id=0)
    at_start = {k: v.clone() for k, v in seen.items()}
    layout = Layout(world, 1, 1)
    pieces = piece_hybrid(rank, engine, gen, layout, layout)
    full = HybridEngine(engine, gen)
    prompts = [[5, 17, 40, 9], [100, 3, 77]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, seed=3)
    runs = {}
    for name, hybrid in (("pieces", pieces), ("full", full)):
        seen.clear()
        out, metrics = hybrid.generate(prompts, params)
        own = {n: t for n, t in gen.model_parameters().items() if t.numel()}  # packed linear weights are empty
        runs[name] = {"out": out, "metrics": metrics, "linear": dict(seen), "own": own,
                      "checksum": compare_weights(hybrid.weights(), None)["train_checksum"]}  # fmt: skip
    gen.close()  # its /dev/shm segments: this process ends with os._exit, past atexit
    p, f = runs["pieces"], runs["full"]
    mask = p["out"]["response_mask"].bool()
    return {
        "linear_layers": sorted(p["linear"]),
        "linear_equal": sorted(p["linear"]) == sorted(f["linear"]) and all(torch.equal(p["linear"][k], f["linear"][k]) for k in f["linear"]),
        "linear_changed": all(not torch.equal(p["linear"][k], at_start[k]) for k in p["linear"]),
        "own_equal": sorted(p["own"]) == sorted(f["own"]) and all(torch.equal(p["own"][k], f["own"][k]) for k in f["own"]),
        "tokens_equal": torch.equal(p["out"]["responses"], f["out"]["responses"]),
        "logprob_diff": float((p["out"]["log_probs"] - f["out"]["log_probs"])[mask].abs().max()),
        "checksums": (p["checksum"], f["checksum"]),
        "whole": pieces.whole,
        "metrics": {k: v for k, v in p["metrics"].items() if k.startswith("reshard/")},
        "full_metrics": {k: v for k, v in f["metrics"].items() if k.startswith("reshard/")},
    }
