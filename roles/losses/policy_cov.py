"""The policy losses that look past a token's own ratio, as verl defines them: GMPO's geometric
mean of a sequence's clipped ratios (`geo_mean`), and Clip-Cov / KL-Cov (Cui et al. 2025), which
pick tokens by the covariance of advantage and log-prob and cut their gradient or add a KL term.

Pure torch on [batch, response_len] tensors; called by hfrt.roles.losses.policy.policy_loss,
which owns dispatch, weights and aggregation. The covariance is over the micro-batch the loss sees
(as in verl); Clip-Cov's random pick draws from the generator it is given, so a seed repeats it.
"""

from __future__ import annotations

import torch

from hfrt.roles.losses.core import masked_mean, masked_sum
from hfrt.roles.losses.policy_config import Metrics, PolicyLossConfig, ppo_kl


def clip_cov_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO's clipped surrogate (no dual clip, no log-ratio clamp, as verl), with the
    gradient cut (loss × 0) at max(1, ⌊clip_cov_ratio · tokens⌋) tokens drawn at random among the
    tokens PPO did not clip whose cov = (A − mean A)(logp − mean logp) lies in (clip_cov_lb,
    clip_cov_ub). actor/pg_clipfrac is the share of cut tokens (verl's definition)."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    valid = mask.bool()
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, mask)) * (log_prob.detach() - masked_mean(log_prob.detach(), mask))
        candidates = valid & ~(clipped > unclipped) & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
        picked = torch.nonzero(candidates)
        count = max(int(config.clip_cov_ratio * float(mask.sum())), 1)
        order = torch.randperm(len(picked), generator=generator).to(picked.device)
        picked = picked[order[:count]]
        keep = torch.ones_like(advantages)
        keep[picked[:, 0], picked[:, 1]] = 0.0
    metrics = {
        "actor/pg_clipfrac": masked_mean((keep == 0).float(), mask).detach(),
        "actor/ppo_kl": ppo_kl(log_ratio, mask),
    }
    return torch.maximum(unclipped, clipped) * keep, metrics


def kl_cov_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: the unclipped surrogate −A·r everywhere, plus ppo_kl_coef·|logp − old| at the
    max(1, ⌊kl_cov_ratio · tokens⌋) tokens of largest covariance (A − mean A)(logp − mean logp)
    (torch.topk: deterministic, no seed needed). actor/ppo_kl is the mean |log ratio| (verl's)."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    penalised = losses + config.ppo_kl_coef * log_ratio.abs()
    valid = mask.bool()
    selected = torch.zeros_like(valid)
    with torch.no_grad():
        adv, logp = advantages[valid], log_prob.detach()[valid]
        if adv.numel():
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(adv.numel() * config.kl_cov_ratio)), largest=True).indices
            flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0][top]
            selected.view(-1)[flat] = True
    metrics = {"actor/ppo_kl": masked_mean(log_ratio.abs(), mask).detach()}
    return torch.where(selected, penalised, losses), metrics


def geo_mean_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025) per sequence: −Ā·exp(mean_t clip_A(logp − old)) with Ā the
    sequence's mean advantage and each token's log-ratio clipped to [−low, high] on the side
    that A's sign makes pessimistic; with weights, × their geometric mean over the sequence.
    Returns [B] losses (the caller averages over sequences) and verl's metrics: pg_clipfrac /
    pg_clipfrac_lower, the share of clipped tokens with A > 0 / A < 0."""
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-config.clip_ratio_low, config.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = mask.sum(dim=-1) + 1e-8  # verl's guard, kept for its numbers
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths)
    per_seq = -(masked_sum(advantages, mask, dim=-1) / lengths) * ratio
    if weights is not None:
        per_seq = per_seq * torch.exp(masked_sum(torch.log(weights + 1e-10), mask, dim=-1) / lengths)
    hit = log_ratio != bounded
    metrics = {
        "actor/pg_clipfrac": masked_mean((hit & (advantages > 0)).float(), mask).detach(),
        "actor/ppo_kl": ppo_kl(log_ratio, mask),
        "actor/pg_clipfrac_lower": masked_mean((hit & (advantages < 0)).float(), mask).detach(),
    }
    return per_seq, metrics
