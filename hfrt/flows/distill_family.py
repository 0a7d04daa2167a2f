"""What the distillation recipes (distill, distill_async) share: the embedded default roles, the
config (samples per prompt, the task reward's weight), and the stages after generation
(`distill_on`: teacher log-probs ∥ reward scores → old log-probs → teacher-minus-student
advantages → actor update).

No torch: futures, handles and settings. It knows role endpoints and their options; nothing of
engines, of the teacher's model, or of where the rollout was generated.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from hfrt.flows.config import FlowConfig
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.ppo_family import ENGINE
from hfrt.flows.tasks import REWARD
from hfrt.flows.timing import Stage, StageTimer
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward

#: The embedded default: the tiny preset as the student; the teacher is the reference
#: implementation over `roles.teacher.options.model` (a trained model folder, e.g. a ppo run's
#: RUN_DIR/hf; the default, the untrained tiny preset, teaches nothing useful); the task's rule
#: reward scores validation (and the step's samples, mixed in with reward_coef).
DISTILL_ROLES: dict[str, dict[str, Any]] = {
    "actor": {"impl": "actor", "options": {"model": "tiny", "engine": ENGINE, "sampling": {"top_k": 0}}},
    "teacher": {"impl": "reference", "options": {"model": "tiny", "engine": {"micro_batch_size": 32}}},
    "reward": {"impl": "reward", "options": {"kind": "function", "function": REWARD}},
}


@dataclass(frozen=True)
class DistillConfig(FlowConfig):
    """FlowConfig plus the samples per prompt and the task reward's weight in the advantage."""

    #: responses sampled per prompt
    n: int = 1
    #: the task reward's weight: each token's advantage is teacher − student log-prob plus
    #: reward_coef × its sequence's score (0: pure distillation)
    reward_coef: float = 0.0
    #: the reverse KL to the teacher is the signal: no entropy bonus by default
    entropy_coeff: float = 0.0
    #: RL steps (FlowConfig's, longer: the student starts from scratch)
    steps: int = 300
    #: prompts per step (FlowConfig's 16 is too few for a student this far from its teacher)
    prompts_per_step: int = 64
    #: a validation pass every N steps and after the last (greedy unless val_temperature)
    val_every: int = 50

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n < 1:
            raise ValueError(f"config n={self.n!r}: must be at least 1")


async def distill_on(
    cfg: DistillConfig, t: StageTimer, rollout: BatchHandle, *, actor: Actor, teacher: Reference, reward: Reward,
    early: tuple[Awaitable[BatchHandle], Awaitable[BatchHandle]] | None = None, stale: bool = False,
) -> dict[str, Any]:
    """Distillation's stages after generation, on a rollout sampled by the actor (distill) or by the
    rollout role (distill_async); the step's metrics (`kl/mean`: the student's reverse KL to the
    teacher on these samples). `early`: the rollout's (teacher log-probs, reward scores) calls,
    already started. The student's log-probs in the advantage are the sampler's when the update is
    on-policy and the actor sampled; with `stale` (the rollout role sampled, with weights up to
    max_staleness versions old) or an off-policy update they are the actor's current ones (one
    forward pass more), so the signal is the reverse KL of the policy being trained."""
    teacher_call, score_call = early or (teacher.compute_log_prob(rollout), reward.score(rollout))
    teacher_lp, scores = await t.together(Stage.STAGE2, teacher_log_prob=teacher_call, reward=score_call)
    old = [] if cfg.on_policy(len(rollout)) and not stale else [
        await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))]
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(
        rollout, scores, *old, teacher_lp, **cfg.advantage_call(estimator="on_policy_distill", distill_reward_coef=cfg.reward_coef)))
    actor_ranks = await t.one(Stage.UPDATE, actor.update(rollout, *old, adv, **cfg.actor_update_options()))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))
