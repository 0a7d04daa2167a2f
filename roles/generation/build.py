"""Building a generating role's generation engine from its options: the built-in HF engine on its
own copy of the model, or vLLM (at a generation tensor-parallel layout when given one). It knows
options and engine constructors; nothing of training, transitions or endpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hfrt.roles.common import build_dataclass
from hfrt.roles.generation.grammar import Grammars
from hfrt.roles.generation.hf import GenerationEngine, HFGenerationEngine
from hfrt.roles.models import ModelConfig, load_model, resolve_model_dir


def text_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """The text a response's ids spell, as returned to callers (special tokens skipped): what stop
    strings are matched against."""

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    return decode


def generation_engine(
    kind: str,
    *,
    model: str,
    dtype: str,
    seed: int,
    tokenizer: Any,
    vllm: Mapping[str, Any] | None = None,
    layout: Any = None,
    lora: Any = None,
) -> GenerationEngine:
    """Engine `kind` ("hf" | "vllm") for `model`; `vllm` holds VLLMConfig fields but model_dir, and
    `layout` (a generation Layout with tp > 1) makes each rank one vLLM rank at that tp. `lora` (an
    AdapterSpec, roles/generation/lora.py): the engine keeps the base weights and receives adapters only."""
    if kind == "hf":
        copy = load_model(ModelConfig(model, dtype, seed=seed))
        if lora is not None:
            from hfrt.roles.generation.lora import AdapterHFGeneration

            return AdapterHFGeneration(copy, lora, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                       decode=text_decoder(tokenizer), grammars=Grammars(tokenizer))
        return HFGenerationEngine(copy, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  decode=text_decoder(tokenizer), grammars=Grammars(tokenizer))
    if kind == "vllm":
        from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine

        fields = dict(vllm or {})
        fields.setdefault("seed", seed)
        fields["model_dir"] = str(resolve_model_dir(model, seed))
        if layout is not None and layout.tp > 1:
            fields["tensor_parallel_size"], fields["data_parallel_size"] = layout.tp, layout.dp
        config = build_dataclass(VLLMConfig, fields, "vllm")
        if lora is not None:
            from hfrt.roles.generation.lora import adapter_vllm_engine

            return adapter_vllm_engine(config, lora, pad_token_id=tokenizer.pad_token_id)  # type: ignore[no-any-return]
        return VLLMGenerationEngine(config, pad_token_id=tokenizer.pad_token_id)
    raise ValueError(f"unknown generator {kind!r}: use hf or vllm")
