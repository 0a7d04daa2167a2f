"""The `rloo` flow: RLOO (REINFORCE Leave-One-Out, Ahmadian et al. 2024) on the built-in addition
task — n samples per prompt, each sample's baseline the mean score of its prompt's other n−1
samples, no critic. Stages as in the paper's pseudo-code: generate → (reference log-probs ∥
reward scores) → old log-probs → advantages (on the actor's rank 0) → actor update.

KL goes into the reward by default (rewards = scores − β·KL(old ‖ ref), kl_coef=0.001, kl
penalty "kl"), as verl's RLOO example sets it (use_kl_in_reward=True, use_kl_loss=False) and as
OpenRLHF does; kl_loss_coef > 0 adds GRPO's KL loss term instead (set kl_coef=0) or as well.
RLOOConfig and `rloo_step` (hfrt.flows.grpo_family) also serve REINFORCE++ and ReMax, whose
configs change only the estimator and its options.

The controller only moves handles. It knows role endpoints and their options, nothing of engines.
"""

from __future__ import annotations

from typing import Any

from hfrt.flows.grpo_family import GRPO_ROLES, RLOOConfig, rloo_step, train
from hfrt.flows.timing import Stage, StageTable

__all__ = ["ROLES", "STAGES", "Config", "flow"]

#: The embedded default: GRPO's roles (actor, reference, reward; no critic).
ROLES: dict[str, dict[str, Any]] = GRPO_ROLES
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"reference": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward",)}),
    (Stage.UPDATE, {"actor": ("train",)}),
)

Config = RLOOConfig


async def flow(ctl: Any, config: RLOOConfig | dict[str, Any]) -> dict[str, Any]:
    return await train(ctl, RLOOConfig.read(config), rloo_step)
