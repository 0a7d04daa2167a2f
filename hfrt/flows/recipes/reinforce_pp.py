"""The `reinforce_pp` flow: REINFORCE++ (Hu 2025) on the built-in addition task — no critic, KL in
the reward (rewards = scores − β·KL(old ‖ ref) per token), each token's discounted return
whitened over the whole batch as its advantage; one sample per prompt by default.
`baseline=true` switches to REINFORCE++-baseline: n >= 2 samples per prompt, each sample's score
minus its prompt's mean score, whitened over the batch.

The stages are RLOO's (`rloo_step`, hfrt.flows.grpo_family): generate → (reference log-probs ∥ reward scores)
→ old log-probs → advantages (on the actor's rank 0) → actor update; only the estimator differs.
verl's REINFORCE++ example puts KL in a loss term instead (kl_loss_coef, kl_loss_type=mse); set
kl_coef=0 and kl_loss_coef > 0 for that. The controller only moves handles and knows nothing of
engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfrt.flows.grpo_family import GRPO_ROLES, RLOOConfig, rloo_step, train
from hfrt.flows.timing import Stage, StageTable

#: The embedded default: actor, reference and reward (no critic).
ROLES: dict[str, dict[str, Any]] = GRPO_ROLES
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"reference": ("forward",), "reward": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward",)}),
    (Stage.UPDATE, {"actor": ("train",)}),
)


@dataclass(frozen=True)
class ReinforcePPConfig(RLOOConfig):
    """RLOOConfig (in-reward KL) with n=1 by default, the returns' discount and the group baseline."""

    prompts_per_step: int = 32
    n: int = 1
    #: the returns' discount
    gamma: float = 1.0
    #: false: REINFORCE++; true: REINFORCE++-baseline (each group's mean subtracted; needs n >= 2)
    baseline: bool = False

    def advantage_options(self) -> dict[str, Any]:
        if self.baseline:
            return super().advantage_options() | {"estimator": "reinforce_plus_plus_baseline"}
        return super().advantage_options() | {"estimator": "reinforce_plus_plus", "gamma": self.gamma}


Config = ReinforcePPConfig


async def flow(ctl: Any, config: ReinforcePPConfig | dict[str, Any]) -> dict[str, Any]:
    # RLOO's stages; cfg.advantage_options() names the REINFORCE++ estimator
    return await train(ctl, ReinforcePPConfig.read(config), rloo_step)
