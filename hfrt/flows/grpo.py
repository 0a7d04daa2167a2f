"""The `grpo` flow: GRPO (Dr.GRPO with norm_adv_by_std=false) on the built-in addition task — n
samples per prompt, the group's reward statistics as the baseline, no critic, KL as a loss term.
Stages as in the paper's pseudo-code: generate → (reference log-probs ∥ reward scores) →
old log-probs → advantages (on the actor's rank 0) → actor update.

The controller only moves handles. It knows role endpoints and their options, nothing of engines.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .common import (
    CALL_TIMEOUT_S,
    FlowConfig,
    MetricsLog,
    StageTimer,
    non_tensor,
    prompts_handle,
    reward_stats,
    rollout_metrics,
)
from .ppo import ROLES as PPO_ROLES
from .tasks import AdditionTask

#: The embedded default: PPO's roles without the critic.
ROLES: dict[str, dict[str, Any]] = {name: s for name, s in PPO_ROLES.items() if name != "critic"}


@dataclass(frozen=True)
class GRPOConfig(FlowConfig):
    """FlowConfig plus n (samples per prompt), norm_adv_by_std (false: Dr.GRPO), and the KL loss
    (kl_loss_coef, kl_loss_type; coefficient 0 turns it off) with its loss_agg_mode."""

    prompts_per_step: int = 8
    n: int = 8
    norm_adv_by_std: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"


async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    cfg = GRPOConfig.read(config)
    actor, reference, reward = await asyncio.gather(
        *(ctl.role(name, timeout_s=CALL_TIMEOUT_S) for name in ("actor", "reference", "reward"))
    )
    task = AdditionTask(cfg.seed, cfg.max_operand)
    with MetricsLog(cfg.run_dir) as log:
        for step in range(cfg.steps):
            log.write({"step": step, **await grpo_step(ctl, cfg, task, actor, reference, reward)})
    return log.summary() | {"controller_bulk_bytes": ctl.stats()["controller_bulk_bytes"]}


async def grpo_step(ctl: Any, cfg: GRPOConfig, task: AdditionTask, actor: Any, reference: Any, reward: Any) -> dict[str, Any]:
    """One GRPO step; returns its metrics."""
    t = StageTimer()
    kw = {"timeout_s": CALL_TIMEOUT_S}
    prompts = prompts_handle(task.batch(cfg.prompts_per_step))
    # Stage 1: generate n responses per prompt (samples of a prompt share its uid)
    rollout = await t.one("generate", actor.generate(
        prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, **kw))
    # Stage 2: prepare experience — the reference and the reward at once
    ref, scores = await t.together(
        "stage2", ref_log_prob=reference.compute_log_prob(rollout, **kw), reward=reward.score(rollout, **kw))
    old = await t.one("old_log_prob", actor.compute_log_prob(rollout, **kw))
    adv = await t.one("advantages", actor.compute_advantages(
        rollout, scores, old, ref, estimator="grpo", norm_adv_by_std=cfg.norm_adv_by_std, **kw))
    # Stage 3: actor training (no critic)
    loss = {"use_kl_loss": cfg.kl_loss_coef > 0, "kl_loss_coef": cfg.kl_loss_coef, "kl_loss_type": cfg.kl_loss_type,
            "loss_agg_mode": cfg.loss_agg_mode, "entropy_coeff": cfg.entropy_coeff, "ppo_epochs": cfg.ppo_epochs, "ppo_mini_batch_size": cfg.ppo_mini_batch_size}
    [actor_m] = await t.one("update", actor.update(rollout, old, ref, adv, **loss, **kw))
    return {
        **reward_stats(non_tensor(scores, "score")), **adv.meta["metrics"], **actor_m,
        **rollout_metrics(rollout.meta), **t.timings, "timing/step_s": t.step_s(),
        "controller_bulk_bytes": ctl.stats()["controller_bulk_bytes"],
    }
