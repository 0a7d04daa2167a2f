"""Rank bodies for test_engine_contract: every training engine on the tiny preset runs the same
calls — a forward asking for everything a forward gives (entropy, Σπ², top-1 flags, a temperature), one
optimizer step whose loss reads the entropy, and a forward after it — for an actor and a critic.

Not a test module: the spawned ranks import it by name.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import model_zoo
from .dist_workers import make_batch, ppo_loss, rows_for

TEMPERATURE = 0.7
#: engine settings by name: every backend, and the TP engine with tp > 1 and with pipeline stages
LAYOUTS: dict[str, dict[str, Any]] = {
    "fsdp2": {"backend": "fsdp2"},
    "tp2": {"backend": "tp", "tp": 2},
    "pp2": {"backend": "tp", "pp": 2},
    "deepspeed": {"backend": "deepspeed", "zero_stage": 3},
}


def actor_loss(out: Any, mb: Mapping[str, torch.Tensor], scale: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO's clipped loss with an entropy bonus, so the step's with_entropy reaches the loss."""
    from hfrt.roles.losses import agg_loss

    loss, metrics = ppo_loss(out, mb, scale)
    entropy = agg_loss(out.entropy, mb["response_mask"], "token-mean", scale)
    return loss - 0.01 * entropy, metrics


def build(settings: Mapping[str, Any], critic: bool) -> Any:
    """An engine over the tiny preset (a critic: with a value head), AdamW with eps 1e-3 so that
    its first step is a smooth function of the gradient (test_mesh_engine says why)."""
    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    model = load_model(ModelConfig("tiny", value_head=critic))
    config = EngineConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-2, eps=1e-3), **settings)
    return build_train_engine(model, config)


def calls(engine: Any, batch: Mapping[str, torch.Tensor], critic: bool) -> dict[str, Any]:
    """forward (everything) → step → forward: the outputs and the step's metrics."""
    before = engine.forward(batch, temperature=TEMPERATURE, with_entropy=True, with_sum_pi_squared=True, with_top1=True)
    if critic:
        metrics = engine.step(model_zoo.value_loss_fn, batch, micro_batch_size=2)
    else:
        metrics = engine.step(actor_loss, batch, micro_batch_size=2, temperature=TEMPERATURE, with_entropy=True)
    after = engine.forward(batch, temperature=TEMPERATURE)
    return {"before": vars(before), "metrics": metrics, "after": vars(after)}


def vocabulary() -> int:
    from hfrt.roles.models import ModelConfig, load_model

    return int(load_model(ModelConfig("tiny")).config.vocab_size)


def contract(rank: int, world: int, *, out_dir: Path, layouts: list[str]) -> dict[str, Any]:
    """Each layout of LAYOUTS in turn, an actor then a critic, on this rank's rows."""
    full = make_batch(vocabulary())
    out: dict[str, Any] = {}
    for name in layouts:
        for critic in (False, True):
            print(f"rank {rank}: {name} {'critic' if critic else 'actor'}", file=sys.stderr, flush=True)
            engine = build(LAYOUTS[name], critic)
            rows = (engine.dp_rank, engine.dp_size)
            out[f"{name}-{'critic' if critic else 'actor'}"] = {"rows": rows, **calls(engine, rows_for(full, *rows), critic)}
            dist.barrier()  # every rank done with this engine (and its groups) before the next
            del engine
    return out
