"""The tensor × pipeline × data parallel training engine (backend "tp", or fsdp2 with tp*pp > 1).

Rank order: a (pp, dp, tp) device mesh, tp innermost:
    rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank
so a tp group is tp consecutive ranks (one node's GPUs), dp groups stride by tp, pp groups by
dp*tp. TP comes from `roles.parallel.tp_model` (plain-tensor Megatron layers), DP from FSDP2
`fully_shard` over the dp sub-mesh (each TP piece sharded again over dp), PP from the model's
stage cut (forward passes only: `step` refuses pp > 1).

It knows nothing of RL losses, generation layouts or resharding; it exposes its coordinates,
groups and this rank's pieces (`local_pieces`) for whoever does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from ..models import transformer_blocks
from ..parallel import tp_model
from ..parallel.shard import ModelShape
from .base import EngineConfig, TrainEngine, optimizer_and_scheduler
from .fsdp2 import _mp_policy


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
