"""The `grpo` flow: GRPO on the built-in addition task — n samples per prompt, the group's reward
statistics as the baseline, no critic, KL as a loss term; by default Dr.GRPO (norm_adv_by_std=false).
Stages as in the paper's pseudo-code: generate → (reference log-probs ∥ reward scores) →
old log-probs (skipped when the update is on-policy) → advantages (on the actor's rank 0) → actor update.

The controller only moves handles. It knows role endpoints and their options, nothing of engines.
"""

from __future__ import annotations

from typing import Any

from hfrt.flows.grpo_family import GRPO_ROLES, GRPOConfig, GRPOFlowConfig, actor_loss_options
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.streaming import streamed_experience
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward

__all__ = ["ROLES", "STAGES", "Config", "flow", "grpo_step"]

#: The embedded default: PPO's roles without the critic.
ROLES: dict[str, dict[str, Any]] = GRPO_ROLES
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"reference": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward_offpolicy",)}),  # skipped when on-policy
    (Stage.UPDATE, {"actor": ("train",)}),
)


Config = GRPOFlowConfig


async def flow(ctl: Any, config: GRPOFlowConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = GRPOFlowConfig.read(config)
    roles = await get_roles(ctl, "actor", "reference", "reward")
    return await Trainer(ctl, cfg, roles).run(lambda step, prompts: grpo_step(cfg, step, prompts, **roles))


async def grpo_step(
    cfg: GRPOConfig, step: int, prompts: BatchHandle, *, actor: Actor, reference: Reference, reward: Reward
) -> dict[str, Any]:
    """One GRPO step on a batch of prompts; returns its metrics."""
    t = StageTimer()
    # Stage 1: generate n responses per prompt (samples of a prompt share its uid), in
    # cfg.stream_chunks calls; stage 2: prepare experience — the reference and the reward at once,
    # on each chunk as it arrives (hfrt/flows/streaming.py)
    rollout, stage2 = await streamed_experience(
        t, lambda chunk, chunks: actor.generate(
            prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            seed=sampling_seed(cfg, step), chunk=chunk, chunks=chunks),
        cfg.stream_chunks,
        lambda part: {"ref_log_prob": reference.compute_log_prob(part), "reward": reward.score(part)})
    ref, scores = stage2["ref_log_prob"], stage2["reward"]
    # Old log-probs: skipped when the update is one optimizer step (the actor then takes its
    # current log-probs, detached, as TRL does): a forward pass fewer, the same update.
    old = [] if cfg.on_policy(len(prompts) * cfg.n) else [
        await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))]
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(
        rollout, scores, *old, ref, **cfg.advantage_call(estimator="grpo", norm_adv_by_std=cfg.norm_adv_by_std)))
    # Stage 3: actor training (no critic)
    actor_ranks = await t.one(Stage.UPDATE, actor.update(rollout, *old, ref, adv, **actor_loss_options(cfg)))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))
