"""The generation model of the 3D-HybridEngine at its own tensor-parallel size: a transformers
causal LM built on the meta device from the config, sharded with the model's TP plan
(tp_plan.apply_tp) over a generation TP DeviceMesh whose groups may be strided across the
training ranks (layout.gen_tp_groups), then given empty storage for this rank's pieces only (the
full model is never materialised); the resharded pieces are adopted or copied into the DTensors'
local tensors. Generation runs with one pipeline stage. It knows layouts and tp_plan; nothing of
engines, resharding or sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hfrt.roles.training.parallel import layout as L
from hfrt.roles.training.parallel import tp_plan


def gen_tp_mesh(train: L.Layout, gen: L.Layout, device_type: str = "cpu") -> Any:
    """The 2-D ("gdp", "tp") DeviceMesh of every generation TP group of the pair, rows in
    generation tp order (a row may be strided, e.g. [0, 2]); its "tp" dimension is this rank's
    generation TP mesh. Collective: every rank calls it with the same layouts."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.tensor(L.gen_tp_groups(train, gen), dtype=torch.int)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("gdp", "tp"))


def empty_tp_model(
    config: Any,
    tp_mesh: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    plan: Mapping[str, str] | None = None,
) -> nn.Module:
    """A causal LM of `config`, tensor-parallel over the 1-D `tp_mesh` (None or size 1: whole),
    whose pieces have storage but no values (fill them with `load_local` or adopt them). Built on
    the meta device; non-parameter buffers (rotary tables, embedding scales) are recomputed by the
    model's own initialiser. plan: TP plan overrides (options.parallel.tp_plan)."""
    from transformers import AutoModelForCausalLM

    tp = 1 if tp_mesh is None else int(tp_mesh.size())
    tp_plan.check_tp(config, tp, "generation parallel")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if tp > 1:
        tp_plan.apply_tp(model, tp_mesh, tp_plan.resolve_plan(model, tp, plan))
    tied = _aliases(model)
    model.to_empty(device=device)
    for alias, name in tied:  # to_empty gives each module its own storage: tie them again
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(name))
    with torch.no_grad():
        for module in model.modules():
            if any(True for _ in module.buffers(recurse=False)):
                model._init_weights(module)  # recomputes its buffers (and overwrites its parameters)
    return model.eval()


def _aliases(model: nn.Module) -> list[tuple[str, str]]:
    first: dict[int, str] = {}
    out = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out.append((name, first[id(param)]))
        first.setdefault(id(param), name)
    return out


def local(param: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's piece of a parameter: a DTensor's local tensor (the very
    object the DTensor computes with, so replacing its .data re-points the DTensor; `to_local()`
    returns a fresh alias that cannot), else the parameter itself."""
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's pieces by HF name (tied parameters once, under their first name)."""
    return {name: local(p) for name, p in model.named_parameters()}


def load_local(model: nn.Module, named: Mapping[str, torch.Tensor] | Any) -> None:
    """Copy pieces (HF names → this rank's local piece) into the model's local tensors."""
    params = local_params(model)
    items = named.items() if isinstance(named, Mapping) else named
    for name, tensor in items:
        target = params.get(name)
        if target is None:
            raise KeyError(f"the generation model has no parameter {name!r}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: the piece is {tuple(tensor.shape)}, this rank's generation piece is {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
