"""The `distill_async` flow: on-policy distillation with generation on a separate `rollout` role that
runs ahead of training by up to `max_staleness` policy versions (as grpo_async does for GRPO): the
student's samples come from the rollout role, the teacher scores every sampled token, and each
token's advantage is teacher minus the current student's log-prob (the actor's, computed on the
samples, so the signal is the reverse KL of the policy being trained), optionally plus
`reward_coef` × the task reward; tis_cap > 0 corrects the off-policy samples with the rollout
engine's own log-probs.

A step: take the rollout started up to max_staleness steps ago → (teacher log-probs ∥ reward
scores) → the student's log-probs → advantages → actor update → publish the new version and start
the next rollouts. The pipeline is hfrt.flows.async_steps' RolloutRoleSteps, the stages after
generation hfrt.flows.distill_family's. It knows role endpoints and their options, nothing of
engines, devices or the teacher's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfrt.flows.async_steps import PipelineSettings, RolloutRoleSteps, Scored, run_and_close
from hfrt.flows.distill_family import DISTILL_ROLES, DistillConfig, distill_on
from hfrt.flows.grpo_family import ROLLOUT_ROLE
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles
from hfrt.protocols import BatchHandle

__all__ = ["ROLES", "STAGES", "AsyncDistill", "Config", "DistillAsyncConfig", "flow"]

#: distill's roles plus one generation-only rollout daemon with the actor's model and sampling.
ROLES: dict[str, dict[str, Any]] = {**DISTILL_ROLES, "rollout": ROLLOUT_ROLE}

#: The step's stages for `hfrt plan`: distill's with generation on the rollout role; the student's
#: log-probs are always computed (the samples are the rollout engine's).
STAGES: StageTable = (
    (Stage.GENERATE, {"rollout": ("generate",)}),
    (Stage.STAGE2, {"teacher": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward",)}),
    (Stage.UPDATE, {"actor": ("train",)}),
)


@dataclass(frozen=True)
class DistillAsyncConfig(DistillConfig, PipelineSettings):
    """distill's settings plus the rollout pipeline's bounds (PipelineSettings)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_pipeline()


Config = DistillAsyncConfig


async def flow(ctl: Any, config: DistillAsyncConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = DistillAsyncConfig.read(config)
    roles = await get_roles(ctl, "actor", "rollout", "teacher", "reward")
    trainer = Trainer(ctl, cfg, roles)
    return await run_and_close(trainer, AsyncDistill(cfg, roles, trainer))


class AsyncDistill(RolloutRoleSteps):
    """The step function of `distill_async`: RolloutRoleSteps scored by (teacher ∥ reward) and
    trained by distillation's stages after generation (distill_on, the student's log-probs the
    actor's current ones)."""

    def __init__(self, cfg: DistillAsyncConfig, roles: dict[str, Any], trainer: Trainer) -> None:
        actor, teacher, reward = roles["actor"], roles["teacher"], roles["reward"]

        def score(rollout: BatchHandle) -> Scored:
            return teacher.compute_log_prob(rollout), reward.score(rollout)

        async def train(t: StageTimer, rollout: BatchHandle, early: Scored | None) -> dict[str, Any]:
            return await distill_on(cfg, t, rollout, early=early, stale=True, actor=actor, teacher=teacher, reward=reward)

        super().__init__(cfg, roles, trainer, score=score, train=train)
