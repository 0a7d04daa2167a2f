"""A Llama-family causal LM turned, in place, into its tensor- and pipeline-parallel form.

Tensor parallel (Megatron-style, plain tensors): each Linear / Embedding keeps only the piece
`shard.tp_piece` gives its tp rank; column-parallel projections compute local output features,
row-parallel ones all-reduce their output, the vocabulary-parallel embedding masks ids outside
its rows and all-reduces, and the head all-gathers full-vocabulary logits (uneven split) so every
consumer of `.logits` works unchanged. Pipeline parallel: a rank keeps only its stage's layers
(`shard.stage_of`); activations go stage to stage over the pp group and the last stage's logits
are broadcast back to every stage; `pipeline_backward` runs the backward stage to stage (one
micro-batch in flight, no 1F1B interleaving).

Parameter names stay the Hugging Face names. This module knows nothing of engines, optimizers,
data parallelism, checkpoints or generation layouts; the shard rules live in `shard`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..engines.base import named_buckets
from ..models import ValueModel, transformer_blocks
from .shard import ModelShape, Piece, even_bounds, split_kind, stage_of, stage_layers, tp_piece

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
        if full is not None and _is_kv(name) and self.tp > self.shape.num_kv_heads:
            return self.tp // self.shape.num_kv_heads
        return 1


def _members(group: Group, ordered: list[int] | None, axis: str) -> tuple[int, list[int]]:
    """(this rank's index along the axis, the axis index of each group member by group rank).
    `ordered`: the group's global ranks in axis order; None means ascending (group rank = index)."""
    size = dist.get_world_size(group)
    if ordered is None:
        return dist.get_rank(group), list(range(size))
    members = dist.get_process_group_ranks(group)  # ascending global ranks = group-rank order
    if sorted(ordered) != sorted(members):
        raise ValueError(f"parallelize: {axis}_ranks {ordered} are not the members {members} of the {axis} group")
    return ordered.index(dist.get_rank()), [ordered.index(r) for r in members]


def layout_of(model: nn.Module) -> ParallelLayout:
    layout = getattr(model, "_hfrt_layout", None)
    if layout is None:
        raise ValueError(f"{type(model).__name__} is not a parallelized model (call tp_model.parallelize first)")
    return layout


def _hf_name(name: str) -> str:
    """A value model's backbone parameter under its causal-LM name (the shard rules match suffixes)."""
    return name.removeprefix("backbone.")


def _is_kv(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("k_proj", "v_proj")


def is_tied(model: nn.Module) -> bool:
    """Whether the model's head shares the embedding's weight."""
    return bool(getattr(_config(model), "tie_word_embeddings", False)) and not isinstance(model, ValueModel)


def _config(model: nn.Module) -> Any:
    return model.backbone.config if isinstance(model, ValueModel) else model.config


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


def _shard_tensor_parallel(model: nn.Module, layout: ParallelLayout) -> None:
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


# ------------------------------------------------------------------------------ pipeline stages


class _Absent(nn.Module):
    """Stands in for a module another pipeline stage holds: no parameters, passes its input on."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


class _AbsentEmbedding(nn.Module):
    """Stands in for the embedding on later stages: zeros of the right shape (replaced by the
    activations the previous stage sends before the first held layer runs)."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden, self.dtype = hidden, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.hidden, dtype=self.dtype, device=ids.device)


class _AbsentHead(nn.Module):
    """The head's place on stages before the last: receives the logits the last stage broadcasts."""

    def __init__(self, layout: ParallelLayout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        last = self.layout.member_of_stage[-1]
        return _broadcast(None, last, self.layout.pp_group, hidden.device)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _send(tensor: torch.Tensor, dst: int, group: Group) -> None:
    header = torch.zeros(8, dtype=torch.long)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header.to(tensor.device), group=group, group_dst=dst)
    dist.send(tensor.contiguous(), group=group, group_dst=dst)


def _recv(src: int, group: Group, device: torch.device) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.long, device=device)
    dist.recv(header, group=group, group_src=src)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    out = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(out, group=group, group_src=src)
    return out


def _broadcast(tensor: torch.Tensor | None, src: int, group: Group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.long, device=device)
    if tensor is not None:
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.broadcast(header, group=group, group_src=src)
    if tensor is None:
        ndim = int(header[0])
        tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=_DTYPES[int(header[1])], device=device)
    else:
        tensor = tensor.contiguous()
    dist.broadcast(tensor, group=group, group_src=src)
    return tensor


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = model.backbone if isinstance(model, ValueModel) else model
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(inner).__name__}: no model.layers list to cut into pipeline stages")
    return layers


def _cut_pipeline_stage(model: nn.Module, layout: ParallelLayout) -> None:
    """Replace what other stages hold by parameter-free stand-ins and hook the stage boundaries."""
    if isinstance(model, ValueModel):
        raise ValueError("pipeline stages: value models (critics) are not supported; use pp=1")
    config = _config(model)
    layers = _decoder_layers(model)
    mine = stage_layers(layout.shape.num_layers, layout.pp, layout.pp_rank)
    first, last = layout.pp_rank == 0, layout.pp_rank == layout.pp - 1
    dtype = next(model.parameters()).dtype
    for index in range(len(layers)):
        if index not in mine:
            layers[index] = _Absent()
    group, member = layout.pp_group, layout.member_of_stage
    if not first:
        setattr(model.model, "embed_tokens", _AbsentEmbedding(config.hidden_size, dtype))  # noqa: B010

        def receive(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            received = _recv(member[layout.pp_rank - 1], group, args[0].device)
            if torch.is_grad_enabled():
                layout.boundary_in = received.requires_grad_(True)
            return (received, *args[1:]), kwargs

        layers[mine.start].register_forward_pre_hook(receive, with_kwargs=True)
    if not last:
        setattr(model.model, "norm", _Absent())  # noqa: B010

        def send(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            _send(hidden.detach(), member[layout.pp_rank + 1], group)
            if torch.is_grad_enabled():
                layout.boundary_out = hidden
            return output

        layers[mine.stop - 1].register_forward_hook(send)
    if last:  # the logits go to every stage, so each rank's forward returns the same output

        def share(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            return _broadcast(output, member[-1], group, output.device)

        head: nn.Module = model.get_submodule("lm_head")
        head.register_forward_hook(share)
    else:
        setattr(model, "lm_head", _AbsentHead(layout))  # noqa: B010


def pipeline_backward(model: nn.Module, loss: torch.Tensor) -> None:
    """Backward of one micro-batch across the pipeline (one micro-batch in flight, GPipe-style):
    the last stage backpropagates `loss` (every stage computed the same loss from the broadcast
    logits), each stage hands the gradient of the activations it received to the previous stage,
    which continues its backward from the activations it sent. Collective over the pp group."""
    layout = layout_of(model)
    if layout.pp == 1:
        loss.backward()
        return
    if layout.pp_rank == layout.pp - 1:
        loss.backward()
    else:
        sent = layout.boundary_out
        if sent is None:
            raise RuntimeError("pipeline_backward: no activations were sent by a forward under autograd")
        sent.backward(_recv(layout.member_of_stage[layout.pp_rank + 1], layout.pp_group, sent.device))
    if layout.pp_rank > 0:
        received = layout.boundary_in
        if received is None or received.grad is None:
            raise RuntimeError("pipeline_backward: the activations received from the previous stage got no gradient")
        _send(received.grad, layout.member_of_stage[layout.pp_rank - 1], layout.pp_group)
    layout.boundary_in = layout.boundary_out = None


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
    shape = ModelShape.of(_config(model))
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    shape.check_tp(tp, "parallelize")
    shape.check_pp(pp, "parallelize")
    tp_rank, tp_of_member = _members(tp_group, tp_ranks, "tp") if tp_group is not None else (0, [0])
    pp_rank, pp_of_member = _members(pp_group, pp_ranks, "pp") if pp_group is not None else (0, [0])
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
        _shard_tensor_parallel(model, layout)
    del layout.full_shapes_by_id  # type: ignore[attr-defined]
    if pp > 1:
        _cut_pipeline_stage(model, layout)
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
            full = _broadcast(full, layout.member_of_stage[owner], layout.pp_group, device)
        assert full is not None
        out[name] = full
    return out


def full_buckets(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Full parameters (full-model names), one decoder layer at a time, then the rest, on every
    rank (see full_block; every rank must exhaust the iterator)."""
    for names in layout_of(model).buckets:
        yield full_block(model, names)
