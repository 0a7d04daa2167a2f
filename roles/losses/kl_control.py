"""In-reward KL: rewards = scores − β·KL(old ‖ ref) per token, and the controllers of β (fixed, or
Ziegler et al.'s adaptive one), as verl's core_algos defines them. Pure torch; it knows nothing of
batches or of the estimator that reads the rewards.
"""

from __future__ import annotations

import torch

from hfrt.roles.losses.core import kl_penalty, masked_mean, zero_masked


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, float]:
    """rewards = scores − β·KL per token (KL of `kind`, 0 where masked), and the batch's current KL:
    the mean over sequences of each sequence's masked mean KL (what a KL controller reads)."""
    mask = response_mask.to(token_level_scores.dtype)
    kld = zero_masked(kl_penalty(old_log_prob, ref_log_prob, kind), mask)
    current = float(masked_mean(kld, mask, dim=-1).mean())
    return token_level_scores - beta * kld, current


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Ziegler et al.'s controller: value ×= 1 + clip(kl / target − 1, ±0.2) · n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl} and {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

