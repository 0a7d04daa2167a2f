"""The `grpo` flow: GRPO on the built-in addition task — n samples per prompt, the group's reward
statistics as the baseline, no critic, KL as a loss term; by default Dr.GRPO (norm_adv_by_std=false).
Stages as in the paper's pseudo-code: generate → (reference log-probs ∥ reward scores) →
old log-probs (skipped when the update is on-policy) → advantages (on the actor's rank 0) → actor update.

The controller only moves handles. It knows role endpoints and their options, nothing of engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfrt.flows.common import CALL_TIMEOUT_S, FlowConfig, StageTimer, get_roles, reduce_rank_metrics, step_metrics
from hfrt.flows.recipes.ppo import ROLES as PPO_ROLES
from hfrt.flows.trainer import Trainer, sampling_seed
from hfrt.protocols import BatchHandle

#: The embedded default: PPO's roles without the critic.
ROLES: dict[str, dict[str, Any]] = {name: s for name, s in PPO_ROLES.items() if name != "critic"}
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("generate", {"actor": ("generate",)}),
    ("stage2", {"reference": ("forward",), "reward": ("forward",)}),
    ("old_log_prob", {"actor": ("forward_offpolicy",)}),  # skipped when on-policy
    ("update", {"actor": ("train",)}),
)


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

    def flow_actor_options(self) -> dict[str, Any]:
        """KL as a loss term (no critic) and the loss aggregation."""
        return {
            "use_kl_loss": self.kl_loss_coef > 0, "kl_loss_coef": self.kl_loss_coef,
            "kl_loss_type": self.kl_loss_type, "loss_agg_mode": self.loss_agg_mode,
        }


@dataclass(frozen=True)
class GRPOFlowConfig(GRPOConfig):
    """The `grpo` flow's own defaults; GRPOConfig's stay as they are for the flows built on it
    (rloo, reinforce_pp, remax, dapo). On the addition task with the tiny model (150 steps, 2 CPU
    cores, four seeds each), std-normalised advantages on 8 prompts × 8 samples collapsed the policy on
    two seeds of four (last-quarter mean reward 0.10 and 0.20): they give a group whose samples
    differ only by the 0.1 form credit the same push as one with a right answer. Dr.GRPO's plain
    differences (norm_adv_by_std=false) on 16 prompts × 8 samples never collapsed (0.35-0.78, mean
    0.57; 0.40 is "always answer 2", the most common sum), at about the same time per step."""

    prompts_per_step: int = 16
    norm_adv_by_std: bool = False


Config = GRPOFlowConfig


async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    cfg = GRPOFlowConfig.read(config)
    roles = await get_roles(ctl, "actor", "reference", "reward")
    return await Trainer(ctl, cfg, roles).run(lambda step, prompts: grpo_step(cfg, step, prompts, **roles))


async def grpo_step(cfg: GRPOConfig, step: int, prompts: BatchHandle, *, actor: Any, reference: Any, reward: Any) -> dict[str, Any]:
    """One GRPO step on a batch of prompts; returns its metrics."""
    t = StageTimer()
    kw = {"timeout_s": CALL_TIMEOUT_S}
    # Stage 1: generate n responses per prompt (samples of a prompt share its uid)
    rollout = await t.one("generate", actor.generate(
        prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        seed=sampling_seed(cfg, step), **kw))
    # Stage 2: prepare experience — the reference and the reward at once
    ref, scores = await t.together(
        "stage2", ref_log_prob=reference.compute_log_prob(rollout, **kw), reward=reward.score(rollout, **kw))
    # Old log-probs: skipped when the update is one optimizer step (the actor then takes its
    # current log-probs, detached, as TRL does): a forward pass fewer, the same update.
    old = [] if cfg.on_policy(len(prompts) * cfg.n) else [
        await t.one("old_log_prob", actor.compute_log_prob(rollout, **kw))]
    adv = await t.one("advantages", actor.compute_advantages(
        rollout, scores, *old, ref, estimator="grpo", norm_adv_by_std=cfg.norm_adv_by_std, **kw))
    # Stage 3: actor training (no critic)
    actor_ranks = await t.one("update", actor.update(rollout, *old, ref, adv, **actor_loss_options(cfg), **kw))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))


def actor_loss_options(cfg: GRPOConfig) -> dict[str, Any]:
    """The actor update's options for GRPO-style flows (KL as a loss term, no critic), with the
    config's policy loss mode, TIS and actor_loss table (checked before launch)."""
    return cfg.actor_update_options()
