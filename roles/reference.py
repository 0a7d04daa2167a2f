"""The reference role daemon: log-probs of the responses under a frozen copy of the initial
policy (the KL anchor of PPO / GRPO).

`FrozenPolicy` is the part without the daemon, so a colocated daemon (roles/colocated.py) can hold
one beside an actor. Options: roles/common.py's; the engine is built with trainable=False (no
optimizer, no gradients). It knows nothing of KL estimators or of the actor.
"""

from __future__ import annotations

from typing import Any

import torch

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.common import (
    ModelOptions,
    build_engine,
    check_options,
    close_group,
    needs_group,
    prepare_process,
    role_errors,
)
from hfrt.roles.components import routing
from hfrt.roles.components.routing import Routing
from hfrt.roles.models import load_tokenizer
from hfrt.roles.rows import forward_inputs, merge
from hfrt.roles.training.engines import TrainEngine
from hfrt.roles.training.text_objectives import pair_log_probs
from hfrt.roles.training.updates import forward_equal
from hfrt.wire.endpoints import Dispatch, endpoint


class FrozenPolicy:
    """A causal LM in a frozen training engine (sharded or not); log-probs only."""

    def __init__(self, context: DaemonContext, opts: ModelOptions) -> None:
        self.engine = build_engine(context, opts)
        self.routing: Routing | None = None  # made by the first rollout that says how its routing is used

    def log_probs(self, batch: Batch, endpoint: str, temperature: float | None = None) -> torch.Tensor:
        """[rows, R] log-probs of `responses` at `temperature` (default: the rollout's, from meta), 0
        where masked; replaying the rollout's recorded MoE routing when its meta says router_replay
        is true (the reference follows the role that sampled it: roles/components/routing.py)."""
        replay = batch.meta.get(routing.META)
        if replay is None or routing.ROUTED_EXPERTS not in batch.tensors:
            return masked_log_probs(self.engine, batch, endpoint, temperature)
        routing.check_stages(self.engine.config.pp, endpoint)  # pipeline stages cannot replay: refused, not skipped
        if self.routing is None or self.routing.value != replay:
            if self.routing is not None and self.routing.trainer is not None:
                self.routing.trainer.remove()
            self.routing = Routing(bool(replay), train_model=self.engine.model, generator=None, where=endpoint)
        out = masked_log_probs(self.engine, batch, endpoint, temperature, *self.routing.columns(batch.tensors))
        self.routing.metrics()  # collective; the actor reports the mismatch, the reference only replays
        return out


def masked_log_probs(
    engine: TrainEngine, batch: Batch, endpoint: str, temperature: float | None = None, *more: str
) -> torch.Tensor:
    """What a reference computes with `engine` (also the LoRA actor's, adapters off): [rows, R]
    log-probs of `responses` at `temperature` (default: the rollout's, from meta), 0 where masked;
    `more`: columns the forward reads besides its inputs (the recorded routing)."""
    tensors = forward_inputs(batch, endpoint, *more)
    temp = float(temperature if temperature is not None else batch.meta.get("temperature", 1.0))
    out = forward_equal(engine, tensors, endpoint, temperature=temp)
    assert out.log_probs is not None
    return out.log_probs * tensors["response_mask"].to(out.log_probs.dtype)


class ReferenceDaemon(Daemon):
    """Endpoints: compute_log_prob (SPLIT) → Batch {ref_log_prob}; compute_pair_log_probs (SPLIT,
    preference pairs as text) → Batch {ref_chosen_logps, ref_rejected_logps}. Also the `teacher`
    of on-policy distillation (the same log-probs, of the student's samples)."""

    #: whether setup joined the role's process group (teardown leaves it); False until it does
    _joined: bool = False

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        check_options(context, ())
        ModelOptions.read(context.options, trainable=False)

    async def setup(self) -> None:
        with role_errors(self.context):
            ctx = self.context
            self.check_config(ctx)
            opts = ModelOptions.read(ctx.options, trainable=False)
            self._joined = prepare_process(ctx, needs_group=needs_group(ctx, opts.engine))
            self.policy = FrozenPolicy(ctx, opts)
            self.tokenizer = load_tokenizer(opts.model, opts.seed)

    async def teardown(self) -> None:
        close_group(self._joined)

    @endpoint(dispatch=Dispatch.SPLIT)
    def compute_log_prob(self, batch: Batch, *extra: Batch, temperature: float | None = None) -> Batch:
        """Reference log-probs of the responses (`ref_log_prob`), 0 where response_mask is 0."""
        merged = merge(batch, extra)
        return Batch({"ref_log_prob": self.policy.log_probs(merged, "reference.compute_log_prob", temperature)})

    @endpoint(dispatch=Dispatch.SPLIT)
    def compute_pair_log_probs(self, batch: Batch, *extra: Batch, max_length: int | None = None) -> Batch:
        """Each preference pair's (`prompt`, `chosen`, `rejected`, tokenised as the actor's
        dpo_update does) summed log-probs of its chosen and rejected completion: `ref_chosen_logps`,
        `ref_rejected_logps`, one row per pair."""
        return pair_log_probs(self.policy.engine, self.tokenizer, merge(batch, extra), "reference.compute_pair_log_probs", max_length)


def reference_options(actor: ModelOptions, overrides: dict[str, Any]) -> ModelOptions:
    """A colocated reference's options: the actor's model, dtype, seed and backend unless overridden."""
    raw_engine = dict(overrides.get("engine") or {})
    raw_engine.setdefault("backend", actor.engine.backend)
    raw_engine.setdefault("zero_stage", actor.engine.zero_stage)
    raw_engine.setdefault("micro_batch_size", actor.engine.micro_batch_size)
    raw_engine.setdefault("mixed_precision", actor.engine.mixed_precision)
    raw_engine.setdefault("max_tokens_per_micro_batch", actor.engine.max_tokens_per_micro_batch)
    raw_engine.setdefault("pack", actor.engine.pack)
    raw_engine.setdefault("shared_prefix", actor.engine.shared_prefix)
    unknown = sorted(set(overrides) - {"model", "dtype", "seed", "engine"})
    if unknown:
        raise ValueError(f"option reference: unknown field(s) {unknown}; expected model, dtype, seed, engine")
    return ModelOptions.read(
        {"model": actor.model, "dtype": actor.dtype, "seed": actor.seed, **overrides, "engine": raw_engine},
        trainable=False,
    )
