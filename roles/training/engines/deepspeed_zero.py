"""The DeepSpeed ZeRO training engine (stage 1, 2 or 3) around a client AdamW.

Gradient accumulation is caller-owned (`managed_gradient_accumulation: false`): each micro-batch
is one `backward`, the step is one `step`. Full weights are gathered per block with
`deepspeed.zero.GatheredParameters` on stage 3; stages 1/2 keep full parameters on every rank.
It knows nothing of losses or generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfrt.roles.models import transformer_blocks
from hfrt.roles.training.engines.base import EngineConfig, TrainEngine, build_optimizer, lr_multiplier, named_buckets

CHECKPOINT_TAG = "hfrt"


def ds_config(config: EngineConfig) -> dict[str, Any]:
    """The DeepSpeed config dict for an EngineConfig (batch sizes are nominal: we drive GA)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max(config.optim.grad_clip, 0.0),
        "zero_optimization": {"stage": config.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": config.mixed_precision == "bf16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _skip_shm_comm_build() -> None:
    """On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op when its comm layer starts
    (~75 s on 2 cores, first time on a machine). Only its inference all-reduce uses it; gloo does
    our collectives, so its builder is replaced by one that builds nothing."""
    import importlib

    # (attribute access would find the `torch` that deepspeed.comm re-exports, not the submodule)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None  # type: ignore[attr-defined]


class DeepSpeedEngine(TrainEngine):
    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        import deepspeed

        if config.zero_stage not in (1, 2, 3):
            raise ValueError(f"DeepSpeed zero_stage must be 1, 2 or 3, got {config.zero_stage}")
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedEngine needs torch.distributed initialised (see engines.init_distributed)")
        if dist.get_backend() == "gloo":
            _skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        super().__init__(model, config)
        self.blocks = transformer_blocks(model)
        self._buckets = named_buckets(model, self.blocks)
        if not config.trainable:
            model.requires_grad_(False)
            self.engine: Any = model.to(self.device)
            self.optimizer = None
            return
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], config.optim)
        factor = lr_multiplier(config.optim)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
            config=ds_config(config),
        )

    @property
    def forward_module(self) -> nn.Module:
        return self.engine

    def _zero_grad(self) -> None:
        self.engine.zero_grad()

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def current_lr(self) -> float:
        return float(self.engine.get_lr()[0]) if self.optimizer is not None else 0.0

    def _gathered_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        import deepspeed

        stage3 = self.config.zero_stage == 3 and self.optimizer is not None
        for _, names in self._buckets:
            params = [self.model.get_parameter(name) for name in names]
            if stage3:
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                    yield {name: p.data for name, p in zip(names, params, strict=True)}
            else:
                yield {name: p.detach() for name, p in zip(names, params, strict=True)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered (test / debugging helper)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self._gathered_buckets():
            out |= {k: v.clone() for k, v in bucket.items()}
        return out

    def _save_into(self, folder: Path) -> None:
        if self.optimizer is None:
            raise RuntimeError("a frozen DeepSpeed engine has nothing to checkpoint")
        # with LoRA only what trains is saved (the frozen base is the model option's)
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, exclude_frozen_parameters=self.lora is not None)

    def _load_from(self, folder: Path) -> None:
        if self.optimizer is None:
            raise RuntimeError("a frozen DeepSpeed engine cannot load a training checkpoint")
        path, _ = self.engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_module_strict=self.lora is None)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint under {folder}")
