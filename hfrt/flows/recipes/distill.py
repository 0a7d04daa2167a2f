"""The `distill` flow: on-policy distillation — the actor (the student) samples, a `teacher` role
(the reference implementation over any causal LM with the student's tokenizer, at its own layout)
returns its log-probs of every sampled token, and each token's advantage is teacher minus student
log-prob (the negative per-token reverse KL), optionally plus `reward_coef` × the task reward
(estimator on_policy_distill, computed on the actor). The update is the policy-gradient loss of
the RL flows; validation, checkpoints, resume and the export are the Trainer's.

Stages: generate → (teacher log-probs ∥ reward scores) → old log-probs (skipped on-policy: the
sampler's are the student's) → advantages (the actor's rank 0) → actor update; the stages after
generation are hfrt.flows.distill_family's, which distill_async runs on the rollout role's samples.
It knows role endpoints and their options, nothing of engines or of the teacher's model.
"""

from __future__ import annotations

from typing import Any

from hfrt.flows.distill_family import DISTILL_ROLES, DistillConfig, distill_on
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward

#: The embedded default: the tiny preset as the student, the teacher a reference daemon over
#: `roles.teacher.options.model`, the task's rule reward (hfrt.flows.distill_family).
ROLES: dict[str, dict[str, Any]] = DISTILL_ROLES
#: The step's stages for `hfrt plan` (torch-free): each stage's name and the calls made in it.
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"teacher": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward_offpolicy",)}),  # skipped when on-policy
    (Stage.UPDATE, {"actor": ("train",)}),
)

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
    return await distill_on(cfg, t, rollout, actor=actor, teacher=teacher, reward=reward)
