"""Which pipeline stage holds which parameter of a causal LM (HF names): decoder layers cut into
contiguous stages, the first stages one layer longer; the input embedding on the first stage, the
final norm and head on the last (a tied head on both). Generic over families: a parameter belongs
to a decoder layer when its name has `layers.<i>.`, to the input embedding when its module is one
of the known embedding names. It knows nothing of tensor parallelism, process groups or engines.
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
#: input-embedding module names across transformers' causal LMs (Llama/Qwen/Gemma/Phi: embed_tokens)
_EMBED = ("embed_tokens", "embed_in", "wte", "word_embeddings")


def layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter name, or None (embedding, final norm, head)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def is_input_embedding(name: str) -> bool:
    return any(part in _EMBED for part in name.split(".")[:-1])


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers of pipeline stage `stage` of `pp` (contiguous, the first num_layers % pp
    stages one longer)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def stage_of(name: str, num_layers: int, pp: int) -> set[int]:
    """The pipeline stages that hold `name`: a decoder layer's parameters their layer's stage, the
    input embedding the first, everything else (final norm, head) the last."""
    layer = layer_of(name)
    if layer is not None:
        base, extra = divmod(num_layers, pp)
        long_part = extra * (base + 1)
        return {layer // (base + 1) if layer < long_part else extra + (layer - long_part) // base}
    if is_input_embedding(name):
        return {0}
    return {pp - 1}


def holds(name: str, num_layers: int, pp: int, stage: int) -> bool:
    return stage in stage_of(name, num_layers, pp)


def check_pp(num_layers: int, pp: int, where: str = "parallel") -> None:
    """Refuse a pipeline size the model's layers cannot take."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"{where}: pp={pp} must be between 1 and the model's {num_layers} layers")
