"""The tensor × pipeline × data parallel training engine on one DeviceMesh (backend "tp", or fsdp2
with tp·pp > 1), composed from torch's own parts the way torchtitan composes them.

Mesh: (pp, dp, tp), tp innermost: rank = (pp_rank·dp_size + dp_rank)·tp_size + tp_rank, so a tp
group is tp consecutive ranks (one node's GPUs), dp groups stride by tp, pp groups by dp·tp.
TP: the model's transformers TP plan as DTensor (parallel/tp_plan), optionally sequence-parallel
(parallel/sequence: micro-batch widths padded to a multiple of tp). PP: the rank's stage of the
model run by a torch.distributed.pipelining schedule (parallel/pipeline; gpipe, 1f1b, or
interleaved-1f1b with v stages per rank: stage s of pp·v on rank s % pp, each its own module). DP:
FSDP2 `fully_shard` over the dp sub-mesh (every TP piece sharded again). Checkpoints: DCP over the
whole world, which reshards on load, so a checkpoint written at one layout loads at any other.
A tied embedding / head held by the first and the last stage gets its gradient summed over both.

It knows nothing of RL losses, generation layouts or resharding; it exposes its coordinates, the
full parameter shapes and buckets, each parameter's tp split dim, and this rank's pieces
(`local_pieces`) for whoever does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from hfrt.roles.losses import LossScale
from hfrt.roles.models import ValueModel, transformer_blocks
from hfrt.roles.training.engines.base import (
    Batch,
    EngineConfig,
    ForwardOutput,
    LossFn,
    PassOptions,
    TrainEngine,
    _comm_device,
    batch_rows,
    named_buckets,
    optimizer_and_scheduler,
    position_ids_from_mask,
)
from hfrt.roles.training.engines.fsdp2 import _mp_policy, engine_state, restore
from hfrt.roles.training.engines.pipeline_loss import Shares
from hfrt.roles.training.parallel import pipeline, sequence, tp_plan, vocab
from hfrt.roles.training.parallel.stages import layer_stage, rank_stages


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


def lm_of(model: nn.Module) -> Any:
    """The transformers model whose plan and embeddings apply (a value model's backbone)."""
    return model.backbone if isinstance(model, ValueModel) else model


class TPEngine(TrainEngine):
    """Training over a (pp, dp, tp) mesh. Every rank of a tp (and pp) group receives the same
    rows; dp groups receive different rows. For the resharding side: mesh (Mesh3D), tp_rank /
    pp_rank / dp_rank, tp_size / pp_size / dp_size, tp_group / pp_group / dp_group, full_shapes,
    buckets, split_dims, local_pieces()."""

    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TPEngine needs torch.distributed initialised (see engines.init_distributed)")
        super().__init__(model, config)
        lm = lm_of(model)
        tp_plan.check_tp(lm.config, config.tp, "engine")
        if config.loss_parallel:
            if isinstance(model, ValueModel):
                raise ValueError("engine: loss_parallel applies to a causal LM's vocabulary head; a value model has none")
            tp_plan.check_loss_parallel(lm.config, config.tp, "engine")
        if config.sequence_parallel:
            sequence.check(lm.config, config.tp, "engine")
        #: pipeline stages this rank holds (interleaved schedules: several, non-adjacent)
        self.virtual = pipeline.stages_per_rank(config.pp_schedule, config.pp_stages_per_rank, config.pp, "engine")
        pipeline.check_pp(tp_plan.text_config(lm.config), config.pp, "engine", self.virtual)
        self.mesh = build_mesh(config.tp, config.pp, self.device.type)
        self.tp_size, self.pp_size, self.dp_size = self.mesh.tp, self.mesh.pp, self.mesh.dp
        self.tp_rank, self.pp_rank, self.dp_rank = self.mesh.tp_rank, self.mesh.pp_rank, self.mesh.dp_rank
        self.tp_group, self.pp_group, self.dp_group = self.mesh.tp_group, self.mesh.pp_group, self.mesh.dp_group
        # the full model's names, shapes and buckets, before anything is cut or sharded
        self.full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.full_dtypes = {n: p.dtype for n, p in model.named_parameters()}
        self.buckets = [names for _, names in named_buckets(model, transformer_blocks(model))]
        self.embedding_name = _param_name(model, lm.get_input_embeddings().weight)
        self.tied = _is_tied(model)
        self.head_name = _head_name(model) if self.tied else ""
        self.owner = self._owner_stages()
        model.to(self.device)
        num_stages = self.pp_size * self.virtual
        if self.pp_size > 1:
            pipeline.cut_stage(model, rank_stages(self.pp_size, self.pp_rank, self.virtual), num_stages)
        #: replicated parameters whose gradients are partial over tp (summed once per step)
        self.partial_grads: list[str] = []
        if self.tp_size > 1:
            prefix = "backbone." if isinstance(model, ValueModel) else ""
            override = dict(config.tp_plan or {})
            plan = tp_plan.resolve_plan(lm, self.tp_size, override, prefix, loss_parallel=config.loss_parallel)
            plan = sequence.sequence_plan(plan) if config.sequence_parallel else plan
            tp_plan.apply_tp(model, self.mesh.mesh["tp"], plan, lm)
            self.partial_grads = tp_plan.partial_grad_names(lm, override, prefix)
            if config.sequence_parallel:  # micro-batches padded to a multiple of tp columns
                params = dict(model.named_parameters())
                partial = {id(params[n]) for n in self.partial_grads if n in params}
                sequence.apply(lm, transformer_blocks(model), self.mesh.mesh["tp"], partial)
                self.seq_multiple = self.tp_size
        self.split_dims = tp_plan.split_dims(model)
        self.embed_group = self._tied_embedding_group()
        self.blocks = transformer_blocks(model)
        mine = rank_stages(self.pp_size, self.pp_rank, self.virtual) if self.pp_size > 1 else []
        self.stages = [pipeline.StageModule(model, s, num_stages) for s in mine]
        for stage in self.stages if config.sequence_parallel else []:
            stage.sequence_mesh = self.mesh.mesh["tp"]
        self.stage = self.stages[0] if self.stages else None  # None: no pipeline
        self.sharded = self.dp_size > 1  # FSDP2 over the dp sub-mesh; a dp of 1 keeps plain tensors
        if self.sharded:
            policy = _mp_policy(config.mixed_precision)
            dp_mesh = self.mesh.mesh["dp"]
            for block in self.blocks:
                fully_shard(block, mesh=dp_mesh, mp_policy=policy)
            for root in self.stages if self.stage is not None else [model]:  # each stage its own FSDP root
                fully_shard(root, mesh=dp_mesh, mp_policy=policy)
        self.optimizer, self.scheduler = optimizer_and_scheduler(model, config)
        self._copies = self._copies_per_param()
        #: activation size and dtype between stages (static pipeline shapes; None: inferred)
        width = int(tp_plan.text_config(lm.config).hidden_size)
        self._hidden = (width, self.full_dtypes[self.embedding_name]) if config.mixed_precision == "fp32" else None
        if self.stage is not None:  # the schedule runs whole rows; the engine falls back, saying why once
            self.sharing.off("pipeline stages exchange activations of one static shape; a cached prefix cannot cross them")

    def _owner_stages(self) -> dict[str, int]:
        """The stage whose copy of each full parameter is authoritative: a decoder layer's stage,
        the embedding's the first, everything else (final norm, head) the last."""
        owner = {}
        layers = len(self.buckets) - 1
        for index, names in enumerate(self.buckets):
            for name in names:
                if index < layers:
                    owner[name] = layer_stage(index, layers, self.pp_size * self.virtual) % self.pp_size
                else:
                    owner[name] = 0 if name == self.embedding_name else self.pp_size - 1
        return owner

    @property
    def forward_module(self) -> nn.Module:
        return self.model

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.mixed_precision == "bf16" and not self.sharded:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _tied_embedding_group(self) -> Any:
        """With pp > 1 and a tied head: the group of the first and last stage at this rank's (dp,
        tp) coordinates (every rank creates every such group, in the same order)."""
        if self.pp_size == 1 or not self.tied:
            return None
        mine = None
        for dp in range(self.dp_size):
            for tp in range(self.tp_size):
                ranks = [dp * self.tp_size + tp, ((self.pp_size - 1) * self.dp_size + dp) * self.tp_size + tp]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        return mine

    def _copies_per_param(self) -> dict[str, int]:
        """How many ranks hold the same values as this rank's piece of each parameter (so each
        value's square counts once in the global gradient norm)."""
        stage_ranks = self.tp_size * self.dp_size
        out = {}
        for name, p in self.model.named_parameters():
            pieces = 1
            if isinstance(p, DTensor):
                for size, placement in zip(p.device_mesh.mesh.shape, p.placements, strict=True):
                    pieces *= 1 if placement.is_replicate() else int(size)  # Shard, or FSDP's _StridedShard
            stages = 2 if self.embed_group is not None and name in (self.embedding_name, self.head_name) else 1
            out[name] = stage_ranks // pieces * stages
        return out

    # ---- passes through the pipeline schedule (pp > 1); pp = 1 runs the base class's micro-batch loop
    def _pipeline_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = dict(batch)
        if "position_ids" not in out:
            out["position_ids"] = position_ids_from_mask(out["attention_mask"])
        if extra := -int(out["input_ids"].shape[1]) % self.seq_multiple:  # padding columns on the left
            for key in ("input_ids", "attention_mask", "position_ids"):
                out[key] = torch.nn.functional.pad(out[key], (extra, 0))
        return out

    def _micro_batches(self, rows: int, size: int | None) -> int:
        # one micro-batch per stage at least (a multiple of pp when interleaved): short ones are padded
        return pipeline.micro_batch_count(rows, size or self.config.micro_batch_size, self.pp_size, self.config.pp_schedule)

    def _pass_context(self) -> contextlib.AbstractContextManager[Any]:
        return vocab.context(self.config.loss_parallel)  # the sharded head's forwards and backwards

    def _forward_pass(self, batch: Batch, micro_batch_size: int | None, options: PassOptions) -> ForwardOutput:
        if self.stage is None:
            return super()._forward_pass(batch, micro_batch_size, options)
        for stage in self.stages:
            stage.eval()
            stage.options = options
        out = self._run(self._pipeline_batch(batch), micro_batch_size, None)
        parts = out if isinstance(out, tuple) else (out,)
        return options.unpack(tuple(p.cpu() for p in parts), self.is_value)

    def _train_pass(
        self, loss_fn: LossFn, batch: Batch, micro_batch_size: int | None, scale: LossScale, options: PassOptions
    ) -> dict[str, float]:
        if self.stage is None:
            return super()._train_pass(loss_fn, batch, micro_batch_size, scale, options)
        full = {k: v.to(self.device) for k, v in self._pipeline_batch(batch).items()}
        for stage in self.stages:
            stage.train()
            stage.options = options
        n = self._micro_batches(batch_rows(full), micro_batch_size)
        # without static shapes (bf16) torch infers the backward's shapes by calling the loss once
        # on the inference forward's output first (garbage): that call must not count
        shares = Shares(loss_fn, full, scale, options, self.is_value, n, probes=1 if self._hidden is None else 0)
        self._run(full, micro_batch_size, shares)
        return self.from_last_stage(shares.metrics())

    def _run(self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None, loss: Any) -> Any:
        assert self.stage is not None
        return pipeline.run_schedule(
            self.stages, group=self.pp_group, device=self.device, schedule=self.config.pp_schedule, batch=batch,
            micro_batches=self._micro_batches(batch_rows(batch), micro_batch_size), loss=loss, hidden=self._hidden,
            seq_shards=self.seq_multiple,
        )  # fmt: skip

    def from_last_stage(self, value: Any) -> Any:
        """`value` as the last stage computed it (the loss, metrics, loss shares), on every stage."""
        if self.pp_size == 1:
            return value
        box: list[Any] = [value if self.pp_rank == self.pp_size - 1 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pp_group, self.pp_size - 1), group=self.pp_group)
        return box[0]

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """Loss scales and metrics: summed over the dp group only (tp / pp replicas hold the same rows)."""
        if self.dp_size > 1:
            device = tensor.device
            work = tensor.to(_comm_device())
            dist.all_reduce(work, group=self.dp_group)
            tensor.copy_(work.to(device))

    def _optimizer_step(self) -> float:
        assert self.optimizer is not None and self.scheduler is not None
        for p in self.model.parameters():  # a gradient laid out unlike its parameter (an embedding's
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:  # may come back whole)
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = {n: _local(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}
        for name in self.partial_grads:
            if name in grads:
                dist.all_reduce(grads[name], group=self.tp_group)
        if self.embed_group is not None:
            for name in (self.embedding_name, self.head_name):
                if name in grads:
                    dist.all_reduce(grads[name], group=self.embed_group)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, grad in grads.items():
            total += grad.double().pow(2).sum() / self._copies[name]
        work = total.to(_comm_device())
        dist.all_reduce(work)  # over the world: every rank's share of every distinct value
        norm = float(work.sqrt())
        limit = self.config.optim.grad_clip
        if limit > 0 and norm > limit:
            coef = limit / (norm + 1e-6)
            for grad in grads.values():
                grad.mul_(coef)
        self.optimizer.step()
        self.scheduler.step()
        return norm

    # ---- weights
    def _unsharded(self, names: list[str]) -> contextlib.AbstractContextManager[None]:
        """The FSDP unit holding `names` gathered over dp for the duration (no-op without FSDP)."""
        if not self.sharded:
            return contextlib.nullcontext()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        held = [n for n in names if n in params]
        if self.tied and self.embedding_name in names and self.embedding_name not in params and self.head_name in params:
            held.append(self.head_name)  # the last stage's tied head
        if not held:  # this stage lacks the bucket (so do its dp peers): nothing to gather
            return contextlib.nullcontext()
        ids = {id(params[n]) for n in held}
        units = [*self.blocks, *(self.stages if self.stage is not None else [self.model])]
        return _gathered(next(u for u in units if ids <= {id(p) for p in u.parameters()}))

    def _local_block(self, names: list[str]) -> dict[str, torch.Tensor]:
        """This rank's tp pieces of `names` its stage holds (a tied head on the last stage comes as
        lm_head.weight); call inside _unsharded."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        block = {n: _local(params[n].detach()) for n in names if n in params}
        if self.tied and self.embedding_name in names and self.embedding_name not in params and self.head_name in params:
            block[self.head_name] = _local(params[self.head_name].detach())
        return block

    def local_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's tp/pp pieces (HF names), gathered over dp, one decoder layer at a time, then
        the rest; buckets this stage does not hold are skipped. Collective over the dp group when
        FSDP shards them: every rank must exhaust it. Tensors may be views of temporary buffers:
        copy what you keep."""
        for names in self.buckets:
            with self._unsharded(names):
                block = self._local_block(names)
                if block:
                    yield block

    def _gathered_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Full weights, one bucket at a time: dp-gathered, tp-gathered, pp-broadcast from the
        owning stage. Collective over the world."""
        for names in self.buckets:
            with self._unsharded(names):
                yield self._full_block(names, lambda p: p.detach())

    def _full_block(self, names: list[str], pick: Any) -> dict[str, torch.Tensor]:
        """pick(parameter) of each of `names` as a full tensor on every rank (tp-gathered, then
        broadcast over pp from the owning stage)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        out = {}
        for name in names:
            full = None
            if self.owner[name] == self.pp_rank:
                held = pick(params[name] if name in params else params[self.head_name])
                full = _full(held) if isinstance(held, DTensor) else held
            out[name] = self._from_stage(full, name)
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's full gradient after a step (test / debugging helper; collective)."""
        names = [n for bucket in self.buckets for n in bucket]
        return {k: v.clone() for k, v in self._full_block(names, lambda p: p.grad).items()}

    def _from_stage(self, full: torch.Tensor | None, name: str) -> torch.Tensor:
        if self.pp_size == 1:
            assert full is not None
            return full
        src = dist.get_global_rank(self.pp_group, self.owner[name])
        if full is None:
            full = torch.empty(self.full_shapes[name], dtype=self.full_dtypes[name], device=self.device)
        work = full.contiguous().to(_comm_device())
        dist.broadcast(work, src=src, group=self.pp_group)
        return work.to(self.device)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter (test / debugging helper; collective)."""
        return {k: v.clone() for bucket in self._gathered_buckets() for k, v in bucket.items()}

    # ---- checkpoints: one DCP folder for the whole world; it loads at any layout
    def _state(self) -> dict[str, Any]:
        return engine_state(self.model, self.optimizer)

    def _save_into(self, folder: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(folder / "dcp"))
        if dist.get_rank() == 0:
            (folder / "layout.json").write_text(json.dumps({"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size}))
            if self.scheduler is not None:
                torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")

    def _load_from(self, folder: Path) -> None:
        restore(self.model, self.optimizer, self.scheduler, self._state(), folder / "dcp")

    def is_checkpoint_leader(self) -> bool:
        return dist.get_rank() == 0

    def _barrier(self) -> None:
        dist.barrier()


def _full(tensor: DTensor) -> torch.Tensor:
    """The whole of a DTensor. Split over one mesh dim: a plain, synchronous all-gather of the
    (DTensor-chunked) pieces over that dim's group; DTensor's own full_tensor() otherwise."""
    placement = tensor.placements[0]
    if tensor.device_mesh.ndim == 1 and placement.is_replicate():
        return tensor.to_local()
    if tensor.device_mesh.ndim != 1 or type(placement) is not Shard:  # e.g. a packed (strided) shard
        return tensor.full_tensor()
    dim = placement.dim % tensor.dim()
    group = tensor.device_mesh.get_group()
    parts = dist.get_world_size(group)
    size = int(tensor.shape[dim])
    bounds = [tp_plan.chunk_bounds(size, parts, i) for i in range(parts)]
    width = max(stop - start for start, stop in bounds)
    local = tensor.to_local().contiguous()
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, width - local.shape[dim]]
    padded = torch.nn.functional.pad(local, pad).to(_comm_device())
    gathered = [torch.empty_like(padded) for _ in range(parts)]
    dist.all_gather(gathered, padded, group=group)
    pieces = [g.narrow(dim, 0, stop - start) for g, (start, stop) in zip(gathered, bounds, strict=True)]
    return torch.cat(pieces, dim=dim).to(local.device)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _param_name(model: nn.Module, param: nn.Parameter) -> str:
    return next(n for n, p in model.named_parameters() if p is param)


def _head_name(model: Any) -> str:
    """The tied head's parameter name on the last stage (e.g. lm_head.weight)."""
    head = model.get_output_embeddings()
    module = next(n for n, m in model.named_modules() if m is head)
    return f"{module}.weight"


def _is_tied(model: Any) -> bool:
    """Whether the causal LM's head shares the embedding's weight (value models have no head)."""
    if isinstance(model, ValueModel):
        return False
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


@contextlib.contextmanager
def _gathered(unit: nn.Module) -> Iterator[None]:
    assert isinstance(unit, FSDPModule)
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()
