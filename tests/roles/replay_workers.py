"""Rank bodies for routing replay on the sharded engines (FSDP2 over dp, the TP engine at tp=2): a
tiny Qwen3-MoE's forward with its own recorded routing replayed equals the plain forward, other
experts forced change it, and an update with replay gives every router a gradient. Not a test
module: spawned ranks import it by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.roles import model_zoo
from tests.roles.dist_workers import make_batch, ppo_loss, rows_for


def own_routing(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows, T, layers, k] of one unsharded copy's routing over the batch (padding not recorded)."""
    from hfrt.roles.generation.routing_record import Recorder

    model = model_zoo.model("qwen3_moe", layers=2).eval()
    rec = Recorder(model)
    with rec.recording(), torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    return rec.routed(int(batch["input_ids"].shape[0]), batch["attention_mask"])


def complement(routed: torch.Tensor, experts: int = 4) -> torch.Tensor:
    """The k = experts / 2 experts each recorded (token, layer) was not routed to; "not recorded" stays."""
    k = routed.shape[-1]
    valid = (routed.long() < experts).all(-1, keepdim=True)
    ids = torch.where(valid, routed.long(), torch.arange(k))
    used = torch.nn.functional.one_hot(ids, experts).sum(-2).bool()
    other = torch.arange(experts).expand_as(used)[~used].reshape(routed.shape)
    return torch.where(valid, other.to(routed.dtype), routed)


def replay_on_engines(rank: int, world: int, *, out_dir: Path) -> dict[str, Any]:
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
    from hfrt.roles.training.router_replay import ROUTED_EXPERTS, RouterReplay, routers

    results: dict[str, Any] = {}
    for name, config in {"fsdp2_d2": EngineConfig(backend="fsdp2", micro_batch_size=2, optim=OptimConfig(lr=1e-2)),
                         "tp_t2": EngineConfig(backend="tp", tp=2, micro_batch_size=2, optim=OptimConfig(lr=1e-2))}.items():
        model = model_zoo.model("qwen3_moe", layers=2)
        engine = build_train_engine(model, config)
        full = make_batch(model.config.vocab_size)
        routed_full = own_routing(full)
        batch = rows_for(full, rank, world) if name.startswith("fsdp2") else full
        routed = rows_for({"r": routed_full}, rank, world)["r"] if name.startswith("fsdp2") else routed_full
        plain = engine.forward_logprobs(batch)
        replay = RouterReplay(engine.model, replay=True)
        same = engine.forward_logprobs(batch | {ROUTED_EXPERTS: routed})
        same_share = replay.metrics()["router_mismatch/own_share"]
        forced_lp = engine.forward_logprobs(batch | {ROUTED_EXPERTS: complement(routed)})
        forced = replay.metrics()
        forced_share, forced_used = forced["router_mismatch/own_share"], forced["router_mismatch/share"]
        engine.step(ppo_loss, batch | {ROUTED_EXPERTS: complement(routed)}, micro_batch_size=2)
        grads = [r.weight.grad for r in routers(engine.model)]
        grads_local = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads if g is not None]
        results[name] = {
            "same_diff": float((same - plain).abs().max()), "same_share": same_share,
            "forced_diff": float((forced_lp - plain).abs().max()), "forced_share": forced_share, "forced_used": forced_used,
            "gate_grads": len(grads_local), "gate_grad_abs": min(float(g.abs().sum()) for g in grads_local),
        }
        replay.remove()
    return results
