"""The vLLM engine's KV cache on CPU is sized from the workload, not vLLM's half of RAM."""

from __future__ import annotations

import pytest
import torch

from hfrt.roles.generation.vllm_engine import VLLMConfig, kv_budget, kv_cache_bytes
from hfrt.roles.models import resolve_model_dir

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "dtype": "float32"}


def test_kv_cache_bytes_counts_k_and_v_of_every_layer_and_kv_head() -> None:
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32
    assert kv_cache_bytes(SMOLLM2, "auto", 1000) == int(per_token * 1000 * 1.1)
    assert kv_cache_bytes(SMOLLM2, "bfloat16", 1000) == int(per_token // 2 * 1000 * 1.1)
    assert kv_cache_bytes({**SMOLLM2, "head_dim": 32}, "float32", 10) == int(per_token // 2 * 10 * 1.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU gpu_memory_utilization sizes the cache")
def test_cpu_budget_follows_the_workload_unless_given() -> None:
    folder = str(resolve_model_dir("tiny"))
    small = kv_budget(VLLMConfig(folder, max_model_len=64, max_num_seqs=8))
    large = kv_budget(VLLMConfig(folder, max_model_len=64, max_num_seqs=32))
    assert small is not None and large is not None and large == pytest.approx(4 * small, rel=0.01)
    assert small < 2**20  # the tiny preset: 2 layers, 2 KV heads of 16, 512 tokens: ~0.3 MB
    assert kv_budget(VLLMConfig(folder, kv_cache_memory_bytes=12345)) == 12345
