"""Which part of each parameter a rank holds under a (tp, pp) model-parallel layout.

The one place that knows the Megatron conventions for a Llama-family causal LM (HF names):
column-parallel projections (q/k/v, gate/up) and the vocabulary-parallel embedding and head split
dim 0; row-parallel projections (o, down) split dim 1; norms are replicated; decoder layers are
cut into contiguous pipeline stages (the embedding on the first, the final norm and head on the
last). Key/value heads are replicated, not split, when tp exceeds their count. It knows nothing
of process groups, engines or data: only names, shapes and sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

#: Split dim 0 (output rows). Biases of these layers split the same way.
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
#: Split dim 1 (input columns). Their biases (if any) are replicated.
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes the rules need, read from a transformers config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @staticmethod
    def of(config: Any) -> ModelShape:
        heads = int(config.num_attention_heads)
        return ModelShape(
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            vocab_size=int(config.vocab_size),
        )

    def check_tp(self, tp: int, where: str = "parallel") -> None:
        """Raise ValueError naming the size that tp does not divide."""
        if tp < 1:
            raise ValueError(f"{where}: tp must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise ValueError(f"{where}: tp={tp} does not divide the model's {self.num_heads} attention heads")
        if tp > self.num_kv_heads and tp % self.num_kv_heads:
            raise ValueError(f"{where}: tp={tp} is not a multiple of the model's {self.num_kv_heads} key/value heads")
        if tp <= self.num_kv_heads and self.num_kv_heads % tp:
            raise ValueError(f"{where}: tp={tp} does not divide the model's {self.num_kv_heads} key/value heads")

    def check_pp(self, pp: int, where: str = "parallel") -> None:
        if pp < 1 or pp > self.num_layers:
            raise ValueError(f"{where}: pp={pp} must be between 1 and the model's {self.num_layers} layers")


@dataclass(frozen=True, slots=True)
class Piece:
    """rows/cols [start, stop) of one parameter along `dim`; dim None means the whole tensor."""

    dim: int | None
    start: int = 0
    stop: int = 0

    def take(self, tensor: Any) -> Any:
        """The piece of a full tensor (a view; no copy)."""
        if self.dim is None:
            return tensor
        return tensor.narrow(self.dim, self.start, self.stop - self.start)


def even_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n is cut into `parts` contiguous parts, the first n % parts
    one longer (an uneven vocabulary splits this way)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def split_kind(name: str) -> str:
    """'column', 'row', 'vocab' or 'replicated' for a parameter name."""
    parts = name.split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    if owner in VOCAB:
        return "vocab"
    if owner in COLUMN:
        return "column"
    if owner in ROW and parts[-1] == "weight":
        return "row"
    return "replicated"


def tp_piece(name: str, shape: tuple[int, ...], tp: int, tp_rank: int, model: ModelShape) -> Piece:
    """The piece of parameter `name` (full shape `shape`) held by tp rank `tp_rank` of `tp`."""
    if tp == 1:
        return Piece(None)
    kind = split_kind(name)
    if kind == "vocab":
        return Piece(0, *even_bounds(shape[0], tp, tp_rank))
    if kind == "row":
        return Piece(1, *even_bounds(shape[1], tp, tp_rank))
    if kind == "column":
        owner = name.split(".")[-2]
        if owner in ("k_proj", "v_proj") and tp > model.num_kv_heads:
            head = tp_rank * model.num_kv_heads // tp  # kv heads replicated over tp / num_kv ranks
            return Piece(0, head * model.head_dim, (head + 1) * model.head_dim)
        return Piece(0, *even_bounds(shape[0], tp, tp_rank))
    return Piece(None)


def layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter name, or None (embedding, final norm, head)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers of pipeline stage `stage` of `pp` (contiguous, the first ones one longer)."""
    return range(*even_bounds(num_layers, pp, stage))


def stage_of(name: str, model: ModelShape, pp: int) -> set[int]:
    """The pipeline stages that hold `name`: the embedding the first, the final norm and head the
    last (a tied head is held by both), a decoder layer's parameters their layer's stage."""
    layer = layer_of(name)
    if layer is not None:
        return {next(s for s in range(pp) if layer in stage_layers(model.num_layers, pp, s))}
    if "embed_tokens" in name:
        return {0}
    return {pp - 1}


def holds(name: str, model: ModelShape, pp: int, pp_rank: int) -> bool:
    return pp_rank in stage_of(name, model, pp)
