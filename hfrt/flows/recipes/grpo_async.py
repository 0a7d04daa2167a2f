"""The `grpo_async` flow: GRPO with generation on a separate `rollout` role that runs ahead of
training by up to `max_staleness` policy versions, the actor's weights pushed to it (bucketed,
checksummed, by handle) after every update, off-policy tokens corrected with truncated importance
sampling against the rollout engine's own log-probs (`tis_cap`).

A step: take the rollout started up to max_staleness steps ago (await late) → (reference log-probs
∥ reward scores; with early_stage2 started as soon as the rollout was there) → old log-probs → advantages → actor update → publish the new version and start
the next rollouts (start early). max_staleness=0 is the synchronous `grpo` flow, sample for sample.
The pipeline and the step around it are hfrt.flows.async_steps' RolloutRoleSteps (distill_async
runs the same with its own scoring and training). It knows role endpoints and their options,
nothing of engines or devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfrt.flows.async_steps import PipelineSettings, RolloutRoleSteps, Scored, run_and_close
from hfrt.flows.grpo_family import GRPO_ROLES, ROLLOUT_ROLE, GRPOFlowConfig, train_on
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles
from hfrt.protocols import BatchHandle

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


@dataclass(frozen=True)
class GRPOAsyncConfig(GRPOFlowConfig, PipelineSettings):
    """grpo's settings plus the rollout pipeline's bounds (PipelineSettings). tis_cap > 0 weights
    each token's loss by min(π_old / π_rollout, tis_cap) with the rollout engine's log-probs
    (policy_loss_mode=decoupled: decoupled PPO)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_pipeline()


Config = GRPOAsyncConfig


async def flow(ctl: Any, config: GRPOAsyncConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = GRPOAsyncConfig.read(config)
    roles = await get_roles(ctl, "actor", "rollout", "reference", "reward")
    trainer = Trainer(ctl, cfg, roles)
    return await run_and_close(trainer, AsyncGRPO(cfg, roles, trainer))


class AsyncGRPO(RolloutRoleSteps):
    """The step function of `grpo_async`: RolloutRoleSteps scored by (reference ∥ reward) and
    trained by grpo's stages after generation (train_on)."""

    def __init__(self, cfg: GRPOAsyncConfig, roles: dict[str, Any], trainer: Trainer) -> None:
        actor, reference, reward = roles["actor"], roles["reference"], roles["reward"]

        def score(rollout: BatchHandle) -> Scored:
            return reference.compute_log_prob(rollout), reward.score(rollout)

        async def train(t: StageTimer, rollout: BatchHandle, early: Scored | None) -> dict[str, Any]:
            return await train_on(cfg, t, rollout, early=early, actor=actor, reference=reference, reward=reward)

        super().__init__(cfg, roles, trainer, score=score, train=train)
