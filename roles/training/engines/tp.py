"""The tensor × pipeline × data parallel training engine (backend "tp", or fsdp2 with tp*pp > 1).

Rank order: a (pp, dp, tp) device mesh, tp innermost:
    rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank
so a tp group is tp consecutive ranks (one node's GPUs), dp groups stride by tp, pp groups by
dp*tp. TP comes from `roles.parallel.tp_model` (plain-tensor Megatron layers), DP from FSDP2
`fully_shard` over the dp sub-mesh (each TP piece sharded again over dp), PP from the model's
stage cut (`tp_model.pipeline_backward`: one micro-batch in flight, no 1F1B); a tied embedding /
head held by the first and last stages gets its gradient summed over the two.

It knows nothing of RL losses, generation layouts or resharding; it exposes its coordinates,
groups and this rank's pieces (`local_pieces`) for whoever does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from hfrt.roles.models import transformer_blocks
from hfrt.roles.training.engines.base import EngineConfig, TrainEngine, _comm_device, optimizer_and_scheduler
from hfrt.roles.training.engines.fsdp2 import _mp_policy, engine_state, restore
from hfrt.roles.training.parallel import tp_model
from hfrt.roles.training.parallel.shard import ModelShape


@dataclass(frozen=True)
class Mesh3D:
    """This rank's place in the (pp, dp, tp) mesh and the three groups through it."""

    mesh: DeviceMesh
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def tp_group(self) -> Any:
        return self.mesh.get_group("tp")

    @property
    def pp_group(self) -> Any:
        return self.mesh.get_group("pp")

    @property
    def dp_group(self) -> Any:
        return self.mesh.get_group("dp")


def build_mesh(tp: int, pp: int, device_type: str = "cpu") -> Mesh3D:
    """The (pp, dp, tp) mesh over the whole world (collective: every rank calls it), dp the rest."""
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"parallel: tp={tp} × pp={pp} does not divide the {world} ranks")
    dp = world // (tp * pp)
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()  # type: ignore[misc]
    return Mesh3D(mesh, tp=tp, pp=pp, dp=dp, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)


class TPEngine(TrainEngine):
    """Training over a (pp, dp, tp) mesh. Every rank of a tp (and pp) group receives the same
    rows; dp groups receive different rows. Attributes for the resharding side: mesh (Mesh3D),
    tp_rank / pp_rank / dp_rank, tp_size / pp_size / dp_size, tp_group / pp_group / dp_group,
    layout (tp_model.ParallelLayout)."""

    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TPEngine needs torch.distributed initialised (see engines.init_distributed)")
        super().__init__(model, config)
        shape = ModelShape.of(model.config)
        shape.check_tp(config.tp, "engine")
        shape.check_pp(config.pp, "engine")
        self.mesh = build_mesh(config.tp, config.pp, self.device.type)
        self.tp_size, self.pp_size, self.dp_size = self.mesh.tp, self.mesh.pp, self.mesh.dp
        self.tp_rank, self.pp_rank, self.dp_rank = self.mesh.tp_rank, self.mesh.pp_rank, self.mesh.dp_rank
        self.tp_group, self.pp_group, self.dp_group = self.mesh.tp_group, self.mesh.pp_group, self.mesh.dp_group
        self.layout = tp_model.parallelize(
            model,
            tp_group=self.tp_group if self.tp_size > 1 else None,
            pp_group=self.pp_group if self.pp_size > 1 else None,
        )
        model.to(self.device)
        self.embed_group = self._tied_embedding_group(model)
        self.blocks = transformer_blocks(model)
        self.sharded = self.dp_size > 1  # FSDP2 over the dp sub-mesh; a dp of 1 keeps plain tensors
        if self.sharded:
            policy = _mp_policy(config.mixed_precision)
            dp_mesh = self.mesh.mesh["dp"]
            for block in self.blocks:
                fully_shard(block, mesh=dp_mesh, mp_policy=policy)
            fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        self.optimizer, self.scheduler = optimizer_and_scheduler(model, config)

    @property
    def forward_module(self) -> nn.Module:
        return self.model

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.mixed_precision == "bf16" and not self.sharded:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _tied_embedding_group(self, model: nn.Module) -> Any:
        """With pp > 1 and a tied head: the group of the first and last stage at this rank's (dp,
        tp) coordinates (every rank creates every such group, in the same order)."""
        if self.pp_size == 1 or not tp_model.is_tied(model):
            return None
        mine = None
        for dp in range(self.dp_size):
            for tp in range(self.tp_size):
                ranks = [dp * self.tp_size + tp, ((self.pp_size - 1) * self.dp_size + dp) * self.tp_size + tp]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        return mine

    def _tied_name(self) -> str | None:
        """This rank's copy of a tied embedding / head that another stage also holds, if any."""
        if self.embed_group is None:
            return None
        return "model.embed_tokens.weight" if self.pp_rank == 0 else "lm_head.weight"

    # ---- training
    def _backward(self, loss: torch.Tensor) -> None:
        tp_model.pipeline_backward(self.model, loss)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """Loss scales and metrics: summed over the dp group only (tp / pp replicas hold the same rows)."""
        if self.dp_size > 1:
            device = tensor.device
            work = tensor.to(_comm_device())
            dist.all_reduce(work, group=self.dp_group)
            tensor.copy_(work.to(device))

    def _optimizer_step(self) -> float:
        assert self.optimizer is not None and self.scheduler is not None
        grads = self._local_grads()
        self._sum_replicated_kv_grads(grads)
        tied = self._tied_name()
        if tied is not None and tied in grads:
            dist.all_reduce(grads[tied], group=self.embed_group)
        norm = self._global_grad_norm(grads)
        limit = self.config.optim.grad_clip
        if limit > 0 and norm > limit:
            coef = limit / (norm + 1e-6)
            for grad in grads.values():
                grad.mul_(coef)
        self.optimizer.step()
        self.scheduler.step()
        return norm

    def _local_grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradient tensors by name (the local shard of an FSDP DTensor gradient)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                out[name] = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        return out

    def _sum_replicated_kv_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """With tp > kv heads, the ranks sharing a kv head each hold part of its gradient: sum them."""
        shape = self.layout.shape
        if self.tp_size <= shape.num_kv_heads:
            return
        head_of = [t * shape.num_kv_heads // self.tp_size for t in self.layout.tp_of_member]  # by group rank
        for name, grad in grads.items():
            if not tp_model.is_kv(name):
                continue
            parts = [torch.empty_like(grad) for _ in range(self.tp_size)]
            dist.all_gather(parts, grad.contiguous(), group=self.tp_group)
            mine = head_of[dist.get_rank(self.tp_group)]
            grad.copy_(sum(p for r, p in enumerate(parts) if head_of[r] == mine))  # type: ignore[arg-type]

    def _global_grad_norm(self, grads: dict[str, torch.Tensor]) -> float:
        """The whole model's gradient norm: each piece's squares once (a value replicated over k tp
        ranks weighs 1/k), summed over tp, pp and (FSDP shards) dp."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tied = self._tied_name()
        for name, grad in grads.items():
            stages = 2 if name == tied else 1  # a tied embedding's two copies count once
            total += grad.double().pow(2).sum() / (self.layout.tp_replicas(name) * stages)
        work = total.to(_comm_device())
        dist.all_reduce(work)  # over the world: every rank's disjoint share
        replicas = 1 if self.sharded else self.dp_size  # plain tensors are replicated over dp
        return float((work / replicas).sqrt())

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    # ---- weights
    def _unsharded(self, names: list[str]) -> contextlib.AbstractContextManager[None]:
        """The FSDP unit holding `names` gathered over dp for the duration (no-op without FSDP)."""
        if not self.sharded:
            return contextlib.nullcontext()
        held = [self.model.get_parameter(n) for n in names if _has_param(self.model, n)]
        ids = {id(p) for p in held}
        unit = next((b for b in self.blocks if ids and ids <= {id(p) for p in b.parameters()}), self.model)
        return _gathered(unit)

    def local_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's tp/pp pieces (HF names), gathered over dp, one decoder layer at a time, then
        the rest. Collective over the dp group when FSDP shards them: every rank must exhaust it.
        Tensors may be views of temporary buffers: copy what you keep."""
        for names in self.layout.buckets:
            with self._unsharded(names):
                block = tp_model.local_block(self.model, names)
                if block:
                    yield block

    def _gathered_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Full weights, one bucket at a time: dp-gathered, tp-gathered, pp-broadcast."""
        for names in self.layout.buckets:
            with self._unsharded(names):
                yield tp_model.full_block(self.model, names)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter (test / debugging helper; collective)."""
        return {k: v.clone() for bucket in self._gathered_buckets() for k, v in bucket.items()}

    # ---- checkpoints: one DCP folder per (tp, pp) coordinate, written by its dp group
    @property
    def _ckpt_name(self) -> str:
        return f"dcp_tp{self.tp_rank}_pp{self.pp_rank}"

    def _state(self) -> dict[str, Any]:
        return engine_state(self.model, self.optimizer)

    def _save_into(self, folder: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(folder / self._ckpt_name), process_group=self.dp_group)
        if self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == 0:
            (folder / "layout.json").write_text(json.dumps({"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size}))
            if self.scheduler is not None:
                torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")

    def _load_from(self, folder: Path) -> None:
        if not (folder / "layout.json").exists():
            raise ValueError(f"checkpoint {folder} was not written by the tp engine (no layout.json)")
        saved = json.loads((folder / "layout.json").read_text())
        mine = {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size}
        if saved != mine:
            raise ValueError(f"checkpoint {folder} was written with layout {saved}, this engine runs {mine}")
        restore(self.model, self.optimizer, self.scheduler, self._state(), folder / self._ckpt_name, self.dp_group)

    def is_checkpoint_leader(self) -> bool:
        return dist.get_rank() == 0

    def _barrier(self) -> None:
        dist.barrier()


def _has_param(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


@contextlib.contextmanager
def _gathered(unit: nn.Module) -> Iterator[None]:
    assert isinstance(unit, FSDPModule)
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()
