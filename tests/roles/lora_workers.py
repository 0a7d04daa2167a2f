"""Rank bodies for the LoRA engine tests (tests/roles/test_lora.py), run in spawned processes by
dist_workers.run_ranks (or in-process with world 1). Not a test module: the ranks import it by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .dist_workers import make_batch, ppo_loss, rows_for


def optimizer_numel(engine: Any) -> int:
    """Elements of AdamW's two moment tensors on this rank (local shards; ZeRO's flat partitions)."""
    from torch.distributed.tensor import DTensor

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    total = 0
    for state in inner.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state.get(key)
            if t is not None:
                total += (t.to_local() if isinstance(t, DTensor) else t).numel()
    return total


def lora_step(rank: int, world: int, *, out_dir: Path, backend: str, zero_stage: int = 3) -> dict[str, Any]:
    """One LoRA PPO step on this rank's rows, the whole adapters, the reference (adapters off)
    against a plain base model, and save → step → load → step."""
    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training import lora
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    model = load_model(ModelConfig("tiny"))
    config = EngineConfig(backend=backend, zero_stage=zero_stage, micro_batch_size=2, optim=OptimConfig(lr=1e-2))
    engine = build_train_engine(model, config, lora.LoraSpec(rank=4, alpha=8.0))
    batch = rows_for(make_batch(model.config.vocab_size), rank, world)
    metrics = engine.step(ppo_loss, batch, micro_batch_size=2)
    adapters = {k: v.cpu() for k, v in engine.adapter_state_dict().items()}
    with lora.adapters_disabled(engine.model):
        ref = engine.forward_logprobs(batch)
    base = build_train_engine(load_model(ModelConfig("tiny")), EngineConfig(backend="local", trainable=False))
    numel = optimizer_numel(engine)
    path = engine.save(out_dir / "ckpt")
    again = engine.step(ppo_loss, batch, micro_batch_size=2)
    engine.load(path)
    replay = engine.step(ppo_loss, batch, micro_batch_size=2)
    return {
        "metrics": metrics, "adapters": adapters, "optimizer_numel": numel,
        "ref_vs_base": float(((ref - base.forward_logprobs(batch)) * batch["response_mask"]).abs().max()),
        "after_save": again, "after_load": replay, "critic": critic_steps(config, batch, out_dir),
    }


def critic_steps(config: Any, batch: dict[str, torch.Tensor], out_dir: Path) -> dict[str, Any]:
    """A LoRA value model (adapters in the backbone, the head in full): two value-loss steps, then
    save → step → load → step."""
    from hfrt.roles.losses import value_loss
    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training import lora
    from hfrt.roles.training.engines import build_train_engine

    engine = build_train_engine(load_model(ModelConfig("tiny", value_head=True)), config, lora.LoraSpec(rank=4, alpha=8.0))
    batch = dict(batch, returns=torch.ones_like(batch["advantages"]))
    batch["old_values"] = engine.forward_values(batch)

    def loss(out: Any, mb: Any, scale: Any) -> Any:
        return value_loss(out.values, mb["returns"], mb["old_values"], mb["response_mask"], 10.0, scale=scale)

    losses = [engine.step(loss, batch)["loss"] for _ in range(2)]
    path = engine.save(out_dir / "critic")
    again = engine.step(loss, batch)["loss"]
    engine.load(path)
    return {"losses": losses, "after_save": again, "after_load": engine.step(loss, batch)["loss"]}
