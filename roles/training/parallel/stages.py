"""Which pipeline rank holds which parameter of a causal LM (HF names): decoder layers cut into
contiguous stages, the first stages one layer longer; the input embedding on the first stage, the
final norm and head on the last (a tied head on both). With v > 1 stages per rank (interleaved
schedules) there are pp·v stages and stage s lives on rank s % pp (torch.distributed.pipelining's
"loop" order), so a rank holds v non-adjacent chunks. Generic over families: a parameter belongs
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


def rank_stages(pp: int, rank: int, virtual: int = 1) -> list[int]:
    """The stages (of pp·virtual) pipeline rank `rank` holds: rank, rank + pp, ... (loop order)."""
    return [rank + k * pp for k in range(virtual)]


def layer_stage(layer: int, num_layers: int, stages: int) -> int:
    """The stage (of `stages`) holding decoder layer `layer`."""
    base, extra = divmod(num_layers, stages)
    long_part = extra * (base + 1)
    return layer // (base + 1) if layer < long_part else extra + (layer - long_part) // base


def stage_of(name: str, num_layers: int, pp: int, virtual: int = 1) -> set[int]:
    """The pipeline ranks that hold `name`: a decoder layer's parameters the rank of their layer's
    stage (of pp·virtual), the input embedding the first rank, everything else (final norm, head)
    the last."""
    layer = layer_of(name)
    if layer is not None:
        return {layer_stage(layer, num_layers, pp * virtual) % pp}
    if is_input_embedding(name):
        return {0}
    return {pp - 1}


def holds(name: str, num_layers: int, pp: int, stage: int, virtual: int = 1) -> bool:
    """Whether pipeline rank `stage` of `pp` (with `virtual` stages per rank) holds `name`."""
    return stage in stage_of(name, num_layers, pp, virtual)


def check_pp(num_layers: int, pp: int, where: str = "parallel", virtual: int = 1) -> None:
    """Refuse a pipeline size the model's layers cannot take (every stage needs a layer)."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"{where}: pp={pp} must be between 1 and the model's {num_layers} layers")
    if virtual < 1 or pp * virtual > num_layers:
        raise ValueError(
            f"{where}: pp={pp} × {virtual} stages per rank = {pp * virtual} stages, more than the model's "
            f"{num_layers} decoder layers (every stage needs one)"
        )
