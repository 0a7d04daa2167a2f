"""The FSDP2 training engine: `fully_shard` on every decoder block and on the root module.

Parameters live as DTensor shards over one data-parallel mesh (gloo on CPU, NCCL on GPU);
gradients are reduce-scattered (averaged) on every backward. It knows nothing of losses or
generation; it gathers one block at a time when asked for full weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hfrt.roles.models import transformer_blocks
from hfrt.roles.training.engines.base import EngineConfig, TrainEngine, named_buckets, optimizer_and_scheduler


def _mp_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class FSDP2Engine(TrainEngine):
    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FSDP2Engine needs torch.distributed initialised (see engines.init_distributed)")
        super().__init__(model, config)
        mesh = init_device_mesh(self.device.type, (self.dp_size,), mesh_dim_names=("dp",))
        policy = _mp_policy(config.mixed_precision)
        self.blocks = transformer_blocks(model)
        for block in self.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self._buckets = named_buckets(model, self.blocks)
        self.optimizer, self.scheduler = optimizer_and_scheduler(model, config)

    @property
    def forward_module(self) -> nn.Module:
        return self.model

    def _optimizer_step(self) -> float:
        assert self.optimizer is not None and self.scheduler is not None
        limit = self.config.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm: Any = torch.nn.utils.clip_grad_norm_(params, limit if limit > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)

    def _gathered_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Unshard one FSDP unit (a block, then the root's own parameters), yield it, reshard."""
        for block, names in self._buckets:
            unit = block if block is not None else self.model
            assert isinstance(unit, FSDPModule)
            unit.unshard()
            try:
                yield {name: self.model.get_parameter(name).detach() for name in names}
            finally:
                unit.reshard()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered with DTensor.full_tensor (test / debugging helper)."""
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        return out

    def _state(self) -> dict[str, Any]:
        return engine_state(self.model, self.optimizer, frozen=self.lora is None)

    def _save_into(self, folder: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(folder / "dcp"))
        if self.dp_rank == 0 and self.scheduler is not None:
            torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")

    def _load_from(self, folder: Path) -> None:
        restore(self.model, self.optimizer, self.scheduler, self._state(), folder / "dcp", frozen=self.lora is None)


def engine_state(model: nn.Module, optimizer: Any, *, frozen: bool = True) -> dict[str, Any]:
    """The distributed state dict a checkpoint holds: {"model": ...} plus "optim" when training.
    frozen=False leaves out parameters that do not train (LoRA: the base is the model option's)."""
    options = StateDictOptions(ignore_frozen_params=not frozen)
    if optimizer is None:
        return {"model": get_state_dict(model, [], options=options)[0]}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def restore(
    model: nn.Module, optimizer: Any, scheduler: Any, state: dict[str, Any], checkpoint: Path, process_group: Any = None,
    *, frozen: bool = True,
) -> None:
    """Load the distributed checkpoint `checkpoint` into `state` (the engine's own state-dict
    layout), then into the model and optimizer; the scheduler from scheduler.pt beside it.
    frozen=False: the checkpoint holds only trainable parameters (see engine_state)."""
    dcp.load(state, checkpoint_id=str(checkpoint), process_group=process_group)
    options = StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)
    set_state_dict(model, optimizer or [], model_state_dict=state["model"], optim_state_dict=state.get("optim", {}),
                   options=options)
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(checkpoint.parent / "scheduler.pt", weights_only=True))
