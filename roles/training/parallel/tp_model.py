"""A Llama-family causal LM turned, in place, into this rank's tensor- and pipeline-parallel form,
and the piece-level API the engines and the resharding use: parallelize / empty_parallel,
load_pieces / load_full, local_pieces / local_block, full_buckets / full_block / gather_full.

Tensor parallel: `tp_layers` (each Linear / Embedding keeps the piece `shard.tp_piece` gives its tp
rank; the head's logits are full-vocabulary, so every consumer of `.logits` works unchanged).
Pipeline parallel: `pp_stage` (a rank keeps only its stage's layers; logits reach every stage;
`pipeline_backward` for training). Parameter names stay the Hugging Face names. This module knows
nothing of engines, optimizers, data parallelism, checkpoints or generation layouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hfrt.roles.models import transformer_blocks
from hfrt.roles.training.engines.base import named_buckets
from hfrt.roles.training.parallel.model_layout import (
    Group,
    ParallelLayout,
    config_of,
    is_kv,
    is_tied,
    layout_of,
    members,
)
from hfrt.roles.training.parallel.pp_stage import broadcast, cut_pipeline_stage, pipeline_backward
from hfrt.roles.training.parallel.shard import ModelShape
from hfrt.roles.training.parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_tensor_parallel,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLayout",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "build_parallel",
    "empty_parallel",
    "full_block",
    "full_buckets",
    "gather_full",
    "is_kv",
    "is_tied",
    "layout_of",
    "load_full",
    "load_pieces",
    "local_block",
    "local_pieces",
    "parallelize",
    "pipeline_backward",
]

# ------------------------------------------------------------------------------------ public API


def parallelize(
    model: nn.Module,
    *,
    tp_group: Group = None,
    pp_group: Group = None,
    tp_ranks: list[int] | None = None,
    pp_ranks: list[int] | None = None,
) -> ParallelLayout:
    """Turn `model` (a full Llama-family causal LM, or a ValueModel when pp is 1) into this rank's
    tensor/pipeline-parallel form, in place. A None group means size 1 on that axis. Every rank
    must start from the same full weights. tp_ranks / pp_ranks: the groups' global ranks in tp-rank /
    stage order when that is not ascending (a strided generation group); default ascending.
    Returns the layout (also kept as model._hfrt_layout)."""
    if getattr(model, "_hfrt_layout", None) is not None:
        raise ValueError("parallelize: this model is already parallelized")
    shape = ModelShape.of(config_of(model))
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    shape.check_tp(tp, "parallelize")
    shape.check_pp(pp, "parallelize")
    tp_rank, tp_of_member = members(tp_group, tp_ranks, "tp") if tp_group is not None else (0, [0])
    pp_rank, pp_of_member = members(pp_group, pp_ranks, "pp") if pp_group is not None else (0, [0])
    layout = ParallelLayout(
        shape=shape,
        tp=tp,
        tp_rank=tp_rank,
        tp_group=tp_group,
        pp=pp,
        pp_rank=pp_rank,
        pp_group=pp_group,
        tp_of_member=tp_of_member,
        member_of_stage=[pp_of_member.index(stage) for stage in range(pp)],
    )
    layout.full_shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    layout.full_shapes_by_id = {id(p): p.shape for p in model.parameters()}  # type: ignore[attr-defined]
    layout.buckets = [names for _, names in named_buckets(model, transformer_blocks(model))]
    if tp > 1:
        shard_tensor_parallel(model, layout)
    del layout.full_shapes_by_id  # type: ignore[attr-defined]
    if pp > 1:
        cut_pipeline_stage(model, layout)
    setattr(model, "_hfrt_layout", layout)  # noqa: B010
    return layout


def build_parallel(full_model: nn.Module, **groups: Any) -> nn.Module:
    """`full_model` sharded in place for this rank's tp / pp coordinates (parallelize's keywords);
    returns the same module. empty_parallel avoids holding the full model at all."""
    parallelize(full_model, **groups)
    return full_model


def empty_parallel(
    config: Any,
    *,
    tp_group: Group = None,
    pp_group: Group = None,
    tp_ranks: list[int] | None = None,
    pp_ranks: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """A causal LM of `config` in this rank's tp / pp form whose pieces are allocated but not
    filled (load_pieces / load_full next): the full model is never materialised. Built on the
    meta device, then only the pieces get storage; rotary tables are recomputed."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parallelize(model, tp_group=tp_group, pp_group=pp_group, tp_ranks=tp_ranks, pp_ranks=pp_ranks)
    first: dict[int, str] = {}
    aliases = []  # tied parameters: to_empty gives each module its own storage, tie them again
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.append((name, first[id(param)]))
        first.setdefault(id(param), name)
    model.to_empty(device=device)
    for alias, name in aliases:
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(name))
    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):  # non-persistent buffers: to_empty left them garbage
            parent, _, child = name.rpartition(".")
            fresh = type(module)(config=config).to(device)
            setattr(model.get_submodule(parent) if parent else model, child, fresh)
    return model


def load_full(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy this rank's piece of each FULL tensor in (full-model names): the entry for pushing
    full weights into a parallel model. Names another pipeline stage holds are skipped; a tied head
    on the last stage takes the embedding's piece."""
    layout = layout_of(model)
    params = named_local(model, aliases=True)
    for name, tensor in named:
        target = params.get(name)
        if target is None and name == "model.embed_tokens.weight" and is_tied(model):
            target = params.get("lm_head.weight")
        if target is None:
            if name in layout.full_shapes and not layout.holds(name):
                continue
            raise KeyError(f"load_full: the parallel model has no parameter {name!r}")
        piece = layout.piece(name, tuple(tensor.shape)).take(tensor)
        if tuple(piece.shape) != tuple(target.shape):
            raise ValueError(
                f"load_full: {name} full tensor {tuple(tensor.shape)} gives a {tuple(piece.shape)} piece on tp rank "
                f"{layout.tp_rank}/{layout.tp}, but the model holds {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(piece)


def named_local(model: nn.Module, *, aliases: bool = False) -> dict[str, nn.Parameter]:
    """This rank's parameters by HF name; aliases=True adds tied names (lm_head.weight)."""
    return dict(model.named_parameters(remove_duplicate=not aliases))


def local_block(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """This rank's pieces (detached) of the full-model parameters `names` that its stage holds; a
    tied head on the last stage comes as lm_head.weight. No communication."""
    layout = layout_of(model)
    params = named_local(model, aliases=True)
    block = {name: params[name].detach() for name in names if name in params}
    tied_head = is_tied(model) and layout.pp > 1 and layout.pp_rank == layout.pp - 1
    if tied_head and "model.embed_tokens.weight" in names and "lm_head.weight" in params:
        block["lm_head.weight"] = params["lm_head.weight"].detach()
    return block


def local_pieces(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's pieces (detached, HF names), one decoder layer at a time, then the rest; buckets
    this stage does not hold are skipped. No communication."""
    for names in layout_of(model).buckets:
        block = local_block(model, names)
        if block:
            yield block


def load_pieces(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy pieces into this rank's parameters (HF names; tied aliases accepted). Raises KeyError
    for a name this rank does not hold and ValueError for a piece of the wrong shape."""
    layout = layout_of(model)
    params = named_local(model, aliases=True)
    for name, tensor in named:
        target = params.get(name)
        if target is None:
            raise KeyError(
                f"load_pieces: this rank (tp {layout.tp_rank}/{layout.tp}, pp {layout.pp_rank}/{layout.pp}) "
                f"holds no parameter {name!r}"
            )
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"load_pieces: {name} piece is {tuple(tensor.shape)} but this rank (tp {layout.tp_rank}/{layout.tp}, "
                f"pp {layout.pp_rank}/{layout.pp}) holds {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)


def gather_full(local: torch.Tensor, name: str, layout: ParallelLayout) -> torch.Tensor:
    """The full tensor of `name` from every tp rank's piece (collective over the tp group; uneven
    pieces padded for the all-gather). Replicated parameters come back as they are."""
    full_shape = tuple(layout.full_shapes[name][0])
    pieces = [layout.piece(name, full_shape, t) for t in layout.tp_of_member]  # by group rank
    dim = pieces[0].dim
    if layout.tp == 1 or dim is None:
        return local
    width = max(p.stop - p.start for p in pieces)
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, width - local.shape[dim]]
    padded = F.pad(local.contiguous(), pad)
    parts = [torch.empty_like(padded) for _ in pieces]
    dist.all_gather(parts, padded, group=layout.tp_group)
    full = torch.empty(full_shape, dtype=local.dtype, device=local.device)
    for part, piece in zip(parts, pieces, strict=True):
        full.narrow(dim, piece.start, piece.stop - piece.start).copy_(part.narrow(dim, 0, piece.stop - piece.start))
    return full


def full_block(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors of the full-model parameters `names` on every rank: gathered over tp,
    broadcast over pp from the owning stage. Collective over both groups."""
    layout = layout_of(model)
    params = named_local(model, aliases=True)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        owner = layout.owner_stage(name)
        full: torch.Tensor | None = None
        if owner == layout.pp_rank:
            full = gather_full(params[name].detach(), name, layout)
        if layout.pp > 1:
            device = next(iter(params.values())).device
            full = broadcast(full, layout.member_of_stage[owner], layout.pp_group, device)
        assert full is not None
        out[name] = full
    return out


def full_buckets(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Full parameters (full-model names), one decoder layer at a time, then the rest, on every
    rank (see full_block; every rank must exhaust the iterator)."""
    for names in layout_of(model).buckets:
        yield full_block(model, names)
