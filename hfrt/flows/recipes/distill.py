"""The `distill` flow: on-policy distillation — the actor (the student) samples, a `teacher` role
(the reference implementation over any causal LM with the student's tokenizer, at its own layout)
returns its log-probs of every sampled token, and each token's advantage is teacher minus student
log-prob (the negative per-token reverse KL), optionally plus `reward_coef` × the task reward
(estimator on_policy_distill, computed on the actor). The update is the policy-gradient loss of
the RL flows; validation, checkpoints, resume and the export are the Trainer's.

Stages: generate → (teacher log-probs ∥ reward scores) → old log-probs (skipped on-policy: the
sampler's are the student's) → advantages (the actor's rank 0) → actor update. It knows role
endpoints and their options, nothing of engines or of the teacher's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfrt.flows.config import FlowConfig
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.ppo_family import ENGINE
from hfrt.flows.tasks import REWARD
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward

#: The embedded default: the tiny preset as the student; the teacher is the reference
#: implementation over `roles.teacher.options.model` (a trained model folder, e.g. a ppo run's
#: RUN_DIR/hf; the default, the untrained tiny preset, teaches nothing useful); the task's rule
#: reward scores validation (and the step's samples, mixed in with reward_coef).
ROLES: dict[str, dict[str, Any]] = {
    "actor": {"impl": "actor", "options": {"model": "tiny", "engine": ENGINE, "sampling": {"top_k": 0}}},
    "teacher": {"impl": "reference", "options": {"model": "tiny", "engine": {"micro_batch_size": 32}}},
    "reward": {"impl": "reward", "options": {"kind": "function", "function": REWARD}},
}
#: The step's stages for `hfrt plan` (torch-free): each stage's name and the calls made in it.
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"teacher": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward_offpolicy",)}),  # skipped when on-policy
    (Stage.UPDATE, {"actor": ("train",)}),
)


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
    #: a greedy validation pass every N steps and after the last
    val_every: int = 50

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n < 1:
            raise ValueError(f"config n={self.n!r}: must be at least 1")


Config = DistillConfig


async def flow(ctl: Any, config: DistillConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = DistillConfig.read(config)
    roles = await get_roles(ctl, "actor", "teacher", "reward")
    return await Trainer(ctl, cfg, roles).run(lambda step, prompts: distill_step(cfg, step, prompts, **roles))


async def distill_step(
    cfg: DistillConfig, step: int, prompts: BatchHandle, *, actor: Actor, teacher: Reference, reward: Reward
) -> dict[str, Any]:
    """One distillation step on a batch of prompts; returns its metrics (`kl/mean`: the student's
    reverse KL to the teacher on its own samples)."""
    t = StageTimer()
    rollout = await t.one(Stage.GENERATE, actor.generate(
        prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=sampling_seed(cfg, step)))
    teacher_lp, scores = await t.together(
        Stage.STAGE2, teacher_log_prob=teacher.compute_log_prob(rollout), reward=reward.score(rollout))
    old = [] if cfg.on_policy(len(prompts) * cfg.n) else [
        await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))]
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(
        rollout, scores, *old, teacher_lp, **cfg.advantage_call(estimator="on_policy_distill", distill_reward_coef=cfg.reward_coef)))
    actor_ranks = await t.one(Stage.UPDATE, actor.update(rollout, *old, adv, **cfg.actor_update_options()))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))

