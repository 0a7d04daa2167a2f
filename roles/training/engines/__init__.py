"""Training engines selected by config, and the process-group set-up they share.

`build_train_engine(model, EngineConfig(backend=...))` is the one entry point; the role daemons
call it and then use the TrainEngine interface (see base). This package knows nothing of
daemons, messages or RL algorithms.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfrt.roles.training.engines.base import Batch, EngineConfig, ForwardOutput, LossFn, OptimConfig, TrainEngine

__all__ = [
    "Batch",
    "EngineConfig",
    "ForwardOutput",
    "LossFn",
    "OptimConfig",
    "TrainEngine",
    "build_train_engine",
    "init_distributed",
]

BACKENDS = ("local", "fsdp2", "deepspeed", "tp")


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 300) -> None:
    """Join the data-parallel process group (gloo on CPU, NCCL with CUDA); no-op if joined."""
    if dist.is_initialized():
        return
    for key, value in {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": world_size,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }.items():
        os.environ.setdefault(key, str(value))
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def build_train_engine(model: nn.Module, config: EngineConfig, lora: Any = None, *, lora_seed: int = 0) -> TrainEngine:
    """The engine for config.backend, wrapping `model` (which it may shard in place). With
    tp * pp > 1 the backend must be "tp" or "fsdp2" (both give the TP engine: FSDP2 over dp).
    `lora` (a hfrt.roles.training.lora.LoraSpec): peft's adapters are injected first, before any
    sharding (A drawn from `lora_seed`, the same on every rank), and only they (and a value
    model's head) train; the engine keeps the spec as `.lora`."""
    if lora is not None:
        from hfrt.roles.training import lora as adapters

        adapters.check_engine(lora, config, "options.lora")
        engine = build_train_engine(adapters.apply(model, lora, seed=lora_seed), config)
        engine.lora = lora
        return engine
    if config.tp * config.pp > 1 or config.backend == "tp":
        if config.backend not in ("tp", "fsdp2"):
            raise ValueError(
                f"tp={config.tp}, pp={config.pp} needs backend 'tp' or 'fsdp2', not {config.backend!r}"
            )
        from hfrt.roles.training.engines.tp import TPEngine

        return TPEngine(model, config)
    if config.backend == "local":
        from hfrt.roles.training.engines.local import LocalEngine

        return LocalEngine(model, config)
    if config.backend == "fsdp2":
        from hfrt.roles.training.engines.fsdp2 import FSDP2Engine

        return FSDP2Engine(model, config)
    if config.backend == "deepspeed":
        from hfrt.roles.training.engines.deepspeed_zero import DeepSpeedEngine

        return DeepSpeedEngine(model, config)
    raise ValueError(f"unknown training backend {config.backend!r}: use one of {', '.join(BACKENDS)}")
