"""Policy-gradient losses by name (verl's policy_loss_mode): clipped PPO (vanilla, with dual clip),
GSPO, CISPO, decoupled PPO, SAPO, GPG, plain REINFORCE, and — from hfrt.roles.losses.policy_cov —
GMPO (geo_mean), Clip-Cov and KL-Cov; each with the metrics verl reports for it.

Pure torch on [batch, response_len] tensors, run inside a training engine's loss function. It
knows nothing of engines, ranks or messages; the rollout-correction weights and mask come in
ready-made (hfrt.roles.losses.corrections), as does the generator of any random choice.
"""

from __future__ import annotations

import torch

from hfrt.roles.losses.core import LossScale, agg_loss, masked_mean, seq_share, zero_masked
from hfrt.roles.losses.corrections import tis_weights
from hfrt.roles.losses.policy_config import Metrics, PolicyLossConfig, TokenLosses, ppo_kl
from hfrt.roles.losses.policy_cov import clip_cov_losses, geo_mean_loss, kl_cov_losses


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    scale: LossScale | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The policy loss of `config.mode` → (loss, metrics).

    weights: detached per-token weights (the rollout correction's importance weights) multiplied
    into each token's loss before aggregation, as verl applies rollout_is_weights; tis_cap adds
    hfrt's truncated weight min(exp(old − rollout), cap) the same way. geo_mean folds the weights
    into one per sequence (their geometric mean). generator: Clip-Cov's random pick.

    decoupled (decoupled PPO, Hilton et al. 2021, as AReaL uses it for stale rollouts): PPO's
    clipped ratio π_θ / π_prox against the proximal policy (`old_log_prob`: the trainer's own
    log-probs before this update), the whole term weighted by min(π_prox / π_behav, tis_cap),
    detached, with the behaviour policy's log-probs `rollout_log_probs` (what the rollout engine
    sampled with, possibly several versions old). Its value is vanilla's with tis_cap; the mode
    states the objective and refuses to run without the behaviour log-probs and the cap.

    Inputs that carry no gradient (old log-probs, advantages, rollout log-probs, weights) are
    zeroed on masked positions first, so NaN there cannot reach the loss or its gradient."""
    old_log_prob, advantages = zero_masked(old_log_prob, mask), zero_masked(advantages, mask)
    losses_of: dict[str, TokenLosses] = {
        "vanilla": vanilla_losses, "gspo": gspo_losses, "cispo": cispo_losses, "decoupled": vanilla_losses,
        "sapo": sapo_losses, "gpg": gpg_losses, "reinforce": reinforce_losses, "clip_cov": clip_cov_losses,
        "kl_cov": kl_cov_losses, "geo_mean": geo_mean_loss,
    }
    if config.mode not in losses_of:
        raise ValueError(f"unknown policy_loss_mode {config.mode!r}; use one of {', '.join(losses_of)}")
    if config.mode == "decoupled" and (config.tis_cap is None or rollout_log_probs is None):
        raise ValueError(
            "policy_loss_mode decoupled needs the behaviour policy's log-probs (the rollout's rollout_log_probs "
            f"column) and tis_cap, the cap of the weight π_prox / π_behav (got tis_cap={config.tis_cap!r}, "
            f"rollout_log_probs {'given' if rollout_log_probs is not None else 'missing'})")
    metrics: Metrics = {}
    if weights is not None:
        weights = zero_masked(weights.detach(), mask)
    if config.tis_cap is not None:
        if rollout_log_probs is None:
            raise ValueError("tis_cap needs the sampler's log-probs (the rollout's rollout_log_probs column)")
        behaviour = zero_masked(rollout_log_probs, mask)
        tis, metrics = tis_weights(old_log_prob, behaviour, mask, config.tis_cap)
        weights = tis if weights is None else weights * tis
        if config.mode == "decoupled":  # how far the proximal policy has moved from the sampler
            metrics["actor/behav_kl"] = masked_mean(behaviour - old_log_prob, mask).detach()
    if config.mode == "geo_mean":
        per_seq, mode_metrics = geo_mean_loss(log_prob, old_log_prob, advantages, mask, config, weights)
        return seq_share(per_seq, mask, scale), mode_metrics | metrics
    losses, mode_metrics = losses_of[config.mode](log_prob, old_log_prob, advantages, mask, config, generator)
    if weights is not None:
        losses = losses * weights
    agg = config.agg_mode
    if config.mode in ("gspo", "sapo") and not config.keep_loss_agg_mode:
        agg = "seq-mean-token-mean"  # verl aggregates these two per sequence, whatever loss_agg_mode says
    return agg_loss(losses, mask, agg, scale, config.norm_horizon), mode_metrics | metrics


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-20.0, 20.0)


def vanilla_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate per token, asymmetric clip and optional dual clip."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    metrics = {
        "actor/ppo_kl": ppo_kl(log_ratio, mask),
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
    }
    if config.clip_ratio_c is not None:
        if config.clip_ratio_c <= 1.0:
            raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {config.clip_ratio_c}")
        bound = -advantages * config.clip_ratio_c
        dual = torch.minimum(losses, bound)
        lower_hit = (losses > bound) & (advantages < 0)
        metrics["actor/pg_clipfrac_lower"] = masked_mean(lower_hit.float(), mask).detach()
        losses = torch.where(advantages < 0, dual, losses)
    return losses, metrics


def gspo_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025) per token: s_i = exp(mean over sequence i's tokens of
    (logp − old)); the token-level ratio s_i,t = sg(s_i)·exp(logp − sg(logp)) has s_i's value
    and, summed over a sequence's tokens, s_i's gradient; clipped as PPO's ratio (no dual clip)."""
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (zero_masked(log_ratio, mask)).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=10.0))
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    metrics = {
        "actor/ppo_kl": ppo_kl(log_ratio, mask),
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
    }
    return torch.maximum(unclipped, clipped), metrics


def cispo_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1): −sg(clip(ratio, 1 − low, 1 + high))·A·logp — every token keeps a
    gradient, the importance weight is clipped and detached."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high).detach()
    metrics = {
        "actor/ppo_kl": ppo_kl(log_ratio, mask),
        "actor/pg_clipfrac": masked_mean((ratio != weight).float(), mask).detach(),
    }
    return -weight * advantages * log_prob, metrics


def sapo_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (Gao et al. 2025): −f(r)·A with the soft gate f(r) = σ(τ(r − 1))·4/τ in place of
    PPO's hard clip, τ = tau_pos where A > 0 and tau_neg elsewhere; f(1) = 2/τ and f'(1) = 1, so
    near the old policy it is PPO's gradient, far from it the gradient fades. Nothing is clipped
    (pg_clipfrac is 0, as verl reports)."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, advantages.new_tensor(config.tau_pos), advantages.new_tensor(config.tau_neg))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    metrics = {"actor/ppo_kl": ppo_kl(log_ratio, mask), "actor/pg_clipfrac": torch.zeros((), device=ratio.device)}
    return -gates * advantages, metrics


def gpg_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (Chu et al. 2025): −logp·A, no ratio and no clip (verl reports no metric for it)."""
    return -log_prob * advantages, {}


def reinforce_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Plain REINFORCE (verl's compute_policy_loss_reinforce): −A·logp, times the rollout
    correction's weights when given (bypass mode: w = π_θ / π_rollout, detached, so the gradient
    is −w·A·∇logp = −A·∇(π_θ / π_rollout)). actor/ppo_kl is old − logp (old: the rollout's
    log-probs in bypass mode)."""
    return -advantages * log_prob, {"actor/ppo_kl": ppo_kl(log_prob - old_log_prob, mask)}
