"""Pipeline stages of a Llama-family model: a rank keeps only its stage's decoder layers (parameter-
free stand-ins replace the rest, so names stay the Hugging Face ones), activations go stage to stage
over the pp group, the last stage's logits are broadcast to every stage, and `pipeline_backward`
runs the backward stage to stage (one micro-batch in flight, no 1F1B interleaving).

It knows nothing of tensor-parallel layers, engines or optimizers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfrt.roles.models import ValueModel
from hfrt.roles.training.parallel.model_layout import Group, ParallelLayout, config_of, layout_of
from hfrt.roles.training.parallel.shard import stage_layers

# ------------------------------------------------------------------------------ pipeline stages


class _Absent(nn.Module):
    """Stands in for a module another pipeline stage holds: no parameters, passes its input on."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


class _AbsentLayer(_Absent):
    """A decoder layer another stage holds. Under a KV cache it still advances the cache by the
    step's tokens with one-float keys per token (one head of width 1), so the cache's length, which
    the model reads from layer 0 for positions and causal masks, is right on every stage (an empty
    tensor would not do: transformers' DynamicLayer reports length 0 for numel 0)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cache = kwargs.get("past_key_values")
        if cache is not None and kwargs.get("use_cache", True):
            marker = hidden.new_zeros(hidden.shape[0], 1, hidden.shape[1], 1)
            cache.update(marker, marker, self.index)
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
        return broadcast(None, last, self.layout.pp_group, hidden.device)


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


def broadcast(tensor: torch.Tensor | None, src: int, group: Group, device: torch.device) -> torch.Tensor:
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


def cut_pipeline_stage(model: nn.Module, layout: ParallelLayout) -> None:
    """Replace what other stages hold by parameter-free stand-ins and hook the stage boundaries."""
    if isinstance(model, ValueModel):
        raise ValueError("pipeline stages: value models (critics) are not supported; use pp=1")
    config = config_of(model)
    layers = _decoder_layers(model)
    mine = stage_layers(layout.shape.num_layers, layout.pp, layout.pp_rank)
    first, last = layout.pp_rank == 0, layout.pp_rank == layout.pp - 1
    dtype = next(model.parameters()).dtype
    for index in range(len(layers)):
        if index not in mine:
            layers[index] = _AbsentLayer(index)
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
            return broadcast(output, member[-1], group, output.device)

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
