"""The `ppo` flow: PPO with a critic and GAE on the built-in addition task, step by step as in the
HybridFlow paper's pseudo-code: generate → (critic values ∥ reference log-probs ∥ reward scores)
→ old log-probs → advantages (on the actor's rank 0) → (critic update ∥ actor update).

The controller only moves handles: every tensor stays on the daemons. It knows role endpoints and
their options; it knows nothing of engines, devices or how a daemon computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.ppo_family import PPO_ROLES, PPOConfig
from hfrt.flows.streaming import streamed_experience
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Critic, Reference, Reward

__all__ = ["ROLES", "STAGES", "Config", "PPOFlowConfig", "flow", "ppo_step"]

#: The embedded default: one local daemon per role, the `tiny` preset, the task's rule reward.
ROLES: dict[str, dict[str, Any]] = PPO_ROLES
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"critic": ("forward",), "reference": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward",)}),
    (Stage.UPDATE, {"critic": ("train",), "actor": ("train",)}),
)


@dataclass(frozen=True)
class PPOFlowConfig(PPOConfig):
    """The `ppo` flow's own defaults, where the embedded run (tiny preset, addition task, sums
    0-4) learns to add; docs/flows.md says why these, the README what they reach. PPOConfig's
    defaults stay as they are for Safe-RLHF."""

    steps: int = 500
    prompts_per_step: int = 64
    kl_coef: float = 0.1
    val_every: int = 100
    STREAMED: ClassVar[bool] = True


Config = PPOFlowConfig


async def flow(ctl: Any, config: PPOFlowConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = PPOFlowConfig.read(config)
    roles = await get_roles(ctl, "actor", "critic", "reference", "reward")
    trainer = Trainer(ctl, cfg, roles, trained=("actor", "critic"))
    return await trainer.run(lambda step, prompts: ppo_step(cfg, step, prompts, **roles))


async def ppo_step(
    cfg: PPOConfig, step: int, prompts: BatchHandle, *, actor: Actor, critic: Critic, reference: Reference, reward: Reward
) -> dict[str, Any]:
    """One PPO step on a batch of prompts; returns its metrics."""
    t = StageTimer()
    # Stage 1: generate responses, in cfg.stream_chunks calls; stage 2: prepare experience —
    # three roles at once, on each chunk as it arrives (hfrt/flows/streaming.py)
    rollout, stage2 = await streamed_experience(
        t, lambda chunk, chunks: actor.generate(
            prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=sampling_seed(cfg, step),
            chunk=chunk, chunks=chunks),
        cfg.stream_chunks,
        lambda part: {"values": critic.compute_values(part), "ref_log_prob": reference.compute_log_prob(part),
                      "reward": reward.score(part)})
    values, ref, scores = stage2["values"], stage2["ref_log_prob"], stage2["reward"]
    # Old log-probs: skipped when the update is on-policy and no KL enters the reward (see grpo)
    old = [] if cfg.kl_coef == 0 and cfg.on_policy(len(prompts)) else [
        await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))]
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(rollout, scores, values, *old, ref, **cfg.advantage_call(
        estimator="gae", gamma=cfg.gamma, lam=cfg.lam, use_kl_in_reward=cfg.kl_coef > 0, kl_coef=cfg.kl_coef,
        kl_ctrl=cfg.kl_ctrl, target_kl=cfg.target_kl, horizon=cfg.kl_horizon)))
    # Stage 3: actor and critic training, at once
    critic_ranks, actor_ranks = await t.together(
        Stage.UPDATE, critic_update=critic.update(rollout, values, adv, **cfg.critic_update_options()),
        actor_update=actor.update(rollout, *old, adv, **cfg.actor_update_options()))
    return step_metrics(
        t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(critic_ranks), reduce_rank_metrics(actor_ranks))
