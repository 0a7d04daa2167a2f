"""The policy-loss settings every mode reads (`PolicyLossConfig`), the metric type and verl's
actor/ppo_kl, shared by hfrt.roles.losses.policy and policy_cov. Pure torch; no loss lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hfrt.roles.losses.core import masked_mean


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Policy-loss settings (hfrt.wire.loss_options.ActorLoss documents each option).

    mode: see POLICY_LOSSES. clip_ratio_low / clip_ratio_high: the ratio is clipped to
        [1 - low, 1 + high] (DAPO's clip-higher uses high > low). clip_ratio_c: vanilla's
        dual-clip bound for negative advantages (Ye et al. 2020), > 1; None disables it.
    agg_mode / norm_horizon: loss aggregation (see agg_loss). keep_loss_agg_mode: gspo and sapo
        use agg_mode instead of verl's fixed seq-mean-token-mean.
    tis_cap: truncated importance sampling cap against the sampler's log-probs (None: off); the
        decoupled mode's cap on the behaviour weight π_prox / π_behav (required there).
    tau_pos / tau_neg: SAPO. clip_cov_* / kl_cov_ratio / ppo_kl_coef: Clip-Cov and KL-Cov.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    agg_mode: str = "token-mean"
    mode: str = "vanilla"
    tis_cap: float | None = None
    norm_horizon: int | None = None
    keep_loss_agg_mode: bool = False
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


Metrics = dict[str, torch.Tensor]
#: (log_prob, old_log_prob, advantages, mask, config, generator) → (per-token losses, metrics)
TokenLosses = Callable[..., tuple[torch.Tensor, Metrics]]


def ppo_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's actor/ppo_kl: the masked mean of old − new log-prob."""
    return masked_mean(-log_ratio, mask).detach()
