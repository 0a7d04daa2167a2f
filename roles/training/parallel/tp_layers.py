"""Megatron-style tensor-parallel layers on plain tensors, and the in-place swap that turns a
Llama-family model's Linear / Embedding modules into them.

Column-parallel projections compute local output features (their input's gradient is all-reduced),
row-parallel ones all-reduce their output, the vocabulary-parallel embedding masks ids outside its
rows and all-reduces, and the head all-gathers full-vocabulary logits (uneven split). It knows
nothing of pipelines, engines or checkpoints; which piece a rank keeps comes from `shard`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hfrt.roles.training.parallel.model_layout import Group, ParallelLayout
from hfrt.roles.training.parallel.shard import Piece, even_bounds, split_kind

# ------------------------------------------------------------------- autograd-aware collectives


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (partial sums of a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather of uneven pieces along the last dim (bounds[g] = group rank g's [start, stop));
    backward keeps this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, bounds: list[tuple[int, int]], rank: int) -> torch.Tensor:
        ctx.bounds, ctx.rank = bounds, rank
        width = max(stop - start for start, stop in bounds)
        padded = F.pad(x.contiguous(), (0, width - x.shape[-1]))
        parts = [torch.empty_like(padded) for _ in bounds]
        dist.all_gather(parts, padded, group=group)
        out = x.new_empty(*x.shape[:-1], max(stop for _, stop in bounds))
        for part, (start, stop) in zip(parts, bounds, strict=True):  # members in any tp order
            out[..., start:stop] = part[..., : stop - start]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start, stop = ctx.bounds[ctx.rank]
        return grad[..., start:stop].contiguous(), None, None, None


# ------------------------------------------------------------------------ tensor-parallel layers


class ColumnParallelLinear(nn.Linear):
    """Holds rows [start, stop) of the full weight; output features are local (or gathered)."""

    tp_group: Group
    gather_bounds: list[tuple[int, int]] | None  # on the head, by group rank: all-gather full-vocab logits
    group_rank: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(_CopyToTP.apply(x, self.tp_group), self.weight, self.bias)
        if self.gather_bounds is not None:
            out = _GatherLastDim.apply(out, self.tp_group, self.gather_bounds, self.group_rank)
        return out


class RowParallelLinear(nn.Linear):
    """Holds columns [start, stop) of the full weight; partial outputs are all-reduced, the
    (replicated) bias added once after."""

    tp_group: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTP.apply(F.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Holds vocabulary rows [vocab_start, vocab_stop); other ids give zeros, summed over tp."""

    tp_group: Group
    vocab_start: int
    vocab_stop: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        out = F.embedding(local, self.weight, pad, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out, self.tp_group)


def _narrow_param(param: nn.Parameter, piece: Piece) -> None:
    if piece.dim is not None:
        param.data = piece.take(param.data).clone()


def shard_tensor_parallel(model: nn.Module, layout: ParallelLayout) -> None:
    """Swap every Linear / Embedding the shard rules split for its parallel class, keeping its piece."""
    done: set[int] = set()  # tied parameters are narrowed once

    def narrow(module: nn.Module, prefix: str, pname: str) -> Piece:
        param = getattr(module, pname)
        piece = layout.piece(f"{prefix}.{pname}", tuple(layout.full_shapes_by_id[id(param)]))  # type: ignore[attr-defined]
        if id(param) not in done:
            _narrow_param(param, piece)
            done.add(id(param))
        return piece

    tp, group = layout.tp, layout.tp_group
    for name, module in list(model.named_modules()):
        kind = split_kind(f"{name}.weight")
        if isinstance(module, nn.Embedding) and kind == "vocab":
            piece = narrow(module, name, "weight")
            pad = module.padding_idx
            _become(
                module,
                VocabParallelEmbedding,
                tp_group=group,
                vocab_start=piece.start,
                vocab_stop=piece.stop,
                num_embeddings=piece.stop - piece.start,
                padding_idx=pad - piece.start if pad is not None and piece.start <= pad < piece.stop else None,
            )
        elif isinstance(module, nn.Linear) and kind in ("column", "vocab"):
            piece = narrow(module, name, "weight")
            if module.bias is not None:
                narrow(module, name, "bias")
            full = layout.full_shapes_by_id[id(module.weight)][0]  # type: ignore[attr-defined]
            bounds = [even_bounds(full, tp, t) for t in layout.tp_of_member] if kind == "vocab" else None
            _become(
                module,
                ColumnParallelLinear,
                tp_group=group,
                group_rank=dist.get_rank(group),
                out_features=piece.stop - piece.start,
                gather_bounds=bounds,
            )
        elif isinstance(module, nn.Linear) and kind == "row":
            piece = narrow(module, name, "weight")
            _become(module, RowParallelLinear, tp_group=group, in_features=piece.stop - piece.start)
        elif name.rsplit(".", 1)[-1] == "self_attn" and hasattr(module, "num_key_value_groups"):
            heads = layout.shape.num_heads // tp
            kv_heads = max(layout.shape.num_kv_heads // tp, 1)
            setattr(module, "num_key_value_groups", heads // kv_heads)  # noqa: B010


def _become(module: nn.Module, cls: type[nn.Module], **attrs: Any) -> None:
    """Turn `module` into its parallel subclass in place (parameters, hooks and names kept)."""
    module.__class__ = cls
    for key, value in attrs.items():
        setattr(module, key, value)
