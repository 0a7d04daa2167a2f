"""Where one rank sits in a tensor/pipeline-parallel model: the ParallelLayout record a parallelized
model carries (tp / pp coordinates, groups, the full model's shapes and buckets).

Shared by tp_layers, pp_stage and tp_model; it knows the shard rules only through `shard`, and
nothing of layers, engines or data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfrt.roles.models import ValueModel
from hfrt.roles.training.parallel.shard import ModelShape, Piece, split_kind, stage_of, tp_piece

Group = Any  # a torch.distributed ProcessGroup, or None for "no parallelism on this axis"


# ----------------------------------------------------------------------------- the layout record


@dataclass
class ParallelLayout:
    """Where one rank sits: its tp / pp coordinates and groups, and what the full model looked like.

    full_shapes: every parameter's full (unsharded) shape and dtype, by the full model's names
    (tied parameters under their first name). buckets: those names grouped by decoder layer, then
    the rest, the order full-weight iteration follows on every rank.
    """

    shape: ModelShape
    tp: int = 1
    tp_rank: int = 0
    tp_group: Group = None
    pp: int = 1
    pp_rank: int = 0
    pp_group: Group = None
    full_shapes: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    buckets: list[list[str]] = field(default_factory=list)
    #: the tp rank of each member of tp_group, by group rank (torch numbers a group's members in
    #: ascending global rank; a generation tp group may be strided in another order)
    tp_of_member: list[int] = field(default_factory=lambda: [0])
    #: the pp_group member (group rank) that runs each stage
    member_of_stage: list[int] = field(default_factory=lambda: [0])
    #: under autograd, the last forward's activations received from the previous stage (a leaf
    #: whose .grad goes back) and sent to the next one (still in this stage's graph)
    boundary_in: torch.Tensor | None = None
    boundary_out: torch.Tensor | None = None

    def piece(self, name: str, full_shape: tuple[int, ...], tp_rank: int | None = None) -> Piece:
        rank = self.tp_rank if tp_rank is None else tp_rank
        return tp_piece(_hf_name(name), tuple(full_shape), self.tp, rank, self.shape)

    def holds(self, name: str) -> bool:
        return self.pp_rank in stage_of(_hf_name(name), self.shape, self.pp)

    def owner_stage(self, name: str) -> int:
        """The stage whose copy of `name` is authoritative (a tied head's: the embedding's)."""
        return min(stage_of(_hf_name(name), self.shape, self.pp))

    def tp_replicas(self, name: str) -> int:
        """How many tp ranks hold the same values of `name` (tp for replicated parameters, tp /
        num_kv_heads for key/value projections when tp exceeds the kv heads, else 1)."""
        full = self.full_shapes.get(name)
        if self.tp == 1:
            return 1
        if split_kind(_hf_name(name)) == "replicated":
            return self.tp
        if full is not None and is_kv(name) and self.tp > self.shape.num_kv_heads:
            return self.tp // self.shape.num_kv_heads
        return 1


def members(group: Group, ordered: list[int] | None, axis: str) -> tuple[int, list[int]]:
    """(this rank's index along the axis, the axis index of each group member by group rank).
    `ordered`: the group's global ranks in axis order; None means ascending (group rank = index)."""
    size = dist.get_world_size(group)
    if ordered is None:
        return dist.get_rank(group), list(range(size))
    ranks = dist.get_process_group_ranks(group)  # ascending global ranks = group-rank order
    if sorted(ordered) != sorted(ranks):
        raise ValueError(f"parallelize: {axis}_ranks {ordered} are not the members {ranks} of the {axis} group")
    return ordered.index(dist.get_rank()), [ordered.index(r) for r in ranks]


def layout_of(model: nn.Module) -> ParallelLayout:
    layout = getattr(model, "_hfrt_layout", None)
    if layout is None:
        raise ValueError(f"{type(model).__name__} is not a parallelized model (call tp_model.parallelize first)")
    return layout


def _hf_name(name: str) -> str:
    """A value model's backbone parameter under its causal-LM name (the shard rules match suffixes)."""
    return name.removeprefix("backbone.")


def is_kv(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("k_proj", "v_proj")


def is_tied(model: nn.Module) -> bool:
    """Whether the model's head shares the embedding's weight."""
    return bool(getattr(config_of(model), "tie_word_embeddings", False)) and not isinstance(model, ValueModel)


def config_of(model: nn.Module) -> Any:
    return model.backbone.config if isinstance(model, ValueModel) else model.config
