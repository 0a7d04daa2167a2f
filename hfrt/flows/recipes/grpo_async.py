"""The `grpo_async` flow: GRPO with generation on a separate `rollout` role that runs ahead of
training by up to `max_staleness` policy versions, the actor's weights pushed to it (bucketed,
checksummed, by handle) after every update, off-policy tokens corrected with truncated importance
sampling against the rollout engine's own log-probs (`tis_cap`).

A step: take the rollout started up to max_staleness steps ago (await late) → (reference log-probs
∥ reward scores; with early_stage2 started as soon as the rollout was there) → old log-probs → advantages → actor update → publish the new version and start
the next rollouts (start early). max_staleness=0 is the synchronous `grpo` flow, sample for sample.
It knows role endpoints and their options, nothing of engines or devices.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from hfrt.flows.async_steps import PipelinedSteps, check_pipeline_settings, run_and_close
from hfrt.flows.grpo_family import GRPO_ROLES, ROLLOUT_ROLE, GRPOFlowConfig, train_on
from hfrt.flows.pipeline import StalenessPolicy, partial_rollout
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward, Rollout, Sampling

__all__ = ["ROLES", "STAGES", "AsyncGRPO", "Config", "GRPOAsyncConfig", "flow"]

#: grpo's roles plus one generation-only rollout daemon with the actor's model and sampling.
ROLES: dict[str, dict[str, Any]] = {**GRPO_ROLES, "rollout": ROLLOUT_ROLE}

#: The step's stages for `hfrt plan`, as in grpo with generation on the rollout role (the weight
#: sync is not priced); tests/flows/test_flow_stages.py checks them against the real calls.
STAGES: StageTable = (
    (Stage.GENERATE, {"rollout": ("generate",)}),
    (Stage.STAGE2, {"reference": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward_offpolicy",)}),  # skipped when on-policy
    (Stage.UPDATE, {"actor": ("train",)}),
)

#: a reference or reward call started as soon as its rollout arrived (early_stage2)
Started = asyncio.Future[BatchHandle]


@dataclass(frozen=True)
class GRPOAsyncConfig(GRPOFlowConfig):
    """grpo's settings plus the rollout pipeline's bounds. tis_cap > 0 weights each token's loss by
    min(π_old / π_rollout, tis_cap) with the rollout engine's log-probs (policy_loss_mode=decoupled:
    decoupled PPO)."""

    #: policy versions a sample may lag behind the actor (0: synchronous)
    max_staleness: int = 1
    #: "wait": rollouts never run further ahead than max_staleness; "drop": rollout_ahead rollouts
    #: stay in flight and samples found too old are generated again
    stale_policy: str = "wait"
    #: rollouts in flight under "drop" (-1: max_staleness)
    rollout_ahead: int = -1
    #: under "drop", too-old prompt groups are dropped one by one; when fewer than this share of a
    #: step's groups survive, the dropped prompts are generated again
    stale_min_keep: float = 0.5
    #: the weight sync's bucket size, in MiB
    sync_bucket_mb: float = 64.0
    #: K > 0: rollouts are generated K new tokens at a time, and a weight sync in between resumes
    #: the unfinished rows with the new weights (0: off)
    partial_rollout_tokens: int = 0
    #: start a rollout's reference log-probs and reward scores as soon as it is generated (while
    #: the actor still trains the step before): worth it when the reference and reward daemons have
    #: devices of their own (e.g. on the generation pool); beside the actor they only take its time
    early_stage2: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_pipeline_settings(self)
        if self.partial_rollout_tokens < 0:
            raise ValueError(f"config partial_rollout_tokens={self.partial_rollout_tokens!r}: must be >= 0 (0: off)")

    def staleness(self) -> StalenessPolicy:
        return StalenessPolicy(self.max_staleness, self.stale_policy, self.rollout_ahead, self.stale_min_keep)


Config = GRPOAsyncConfig


async def flow(ctl: Any, config: GRPOAsyncConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = GRPOAsyncConfig.read(config)
    roles = await get_roles(ctl, "actor", "rollout", "reference", "reward")
    trainer = Trainer(ctl, cfg, roles)
    return await run_and_close(trainer, AsyncGRPO(cfg, roles, trainer))


class AsyncGRPO(PipelinedSteps):
    """The step function of `grpo_async`: PipelinedSteps whose rollout is the rollout role's
    `generate` (or partial_rollout), with reference and reward started early on request."""

    def __init__(self, cfg: GRPOAsyncConfig, roles: dict[str, Any], trainer: Trainer) -> None:
        self.cfg = cfg
        self._stage2: dict[int, list[tuple[BatchHandle, Started, Started]]] = {}  # step → (rollout, ref, scores) started early
        self.actor: Actor = roles["actor"]
        self.rollout: Rollout = roles["rollout"]
        self.reference: Reference = roles["reference"]
        self.reward: Reward = roles["reward"]
        super().__init__(cfg, roles, trainer)

    def _generate(self, step: int, prompts: BatchHandle) -> Awaitable[BatchHandle]:
        cfg = self.cfg
        sampling = Sampling(n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=sampling_seed(cfg, step))
        call: Awaitable[BatchHandle]
        if cfg.partial_rollout_tokens:
            call = partial_rollout(self.rollout, prompts, segment_tokens=cfg.partial_rollout_tokens, **sampling)
        else:
            call = self.rollout.generate(prompts, **sampling)
        return self._then_stage2(step, call)

    async def _then_stage2(self, step: int, call: Awaitable[BatchHandle]) -> BatchHandle:
        """The rollout; with early_stage2, its reference log-probs and reward scores are started as
        soon as it is there (start early: they run while the actor still trains an earlier step)
        and `__call__` uses them if the step trains on this very rollout (not on a part of it)."""
        rollout = await call
        if not self.cfg.early_stage2:
            return rollout
        ref = asyncio.ensure_future(self.reference.compute_log_prob(rollout))
        scores = asyncio.ensure_future(self.reward.score(rollout))
        for future in (ref, scores):  # an unused pair's error is not "never retrieved"
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._stage2.setdefault(step, []).append((rollout, ref, scores))
        return rollout

    async def __call__(self, step: int, prompts: BatchHandle) -> dict[str, Any]:
        t = StageTimer()
        rollout, info = await self._take(t, step, prompts)
        early = next(((ref, scores) for batch, ref, scores in self._stage2.pop(step, []) if batch is rollout), None)
        record = await train_on(self.cfg, t, rollout, early=early, actor=self.actor, reference=self.reference, reward=self.reward)
        info |= await self._publish(t, step)
        trained_s = max(t.step_s() - info["async/train_wait_s"], 1e-9)
        info["perf/train_tokens_per_s"] = float(record.get("response_tokens", 0.0)) / trained_s
        return record | info | {"timing/step_s": t.step_s()}
