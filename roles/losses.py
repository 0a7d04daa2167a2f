"""PPO-family math on [batch, response_len] tensors: policy losses (clipped PPO, GSPO, CISPO,
decoupled PPO, truncated importance sampling), value, entropy, KL, aggregation, advantage estimators (GAE, GRPO, RLOO, REINFORCE++, ReMax) and in-reward KL controllers.

Pure torch functions, run daemon-side inside a training engine's loss function. They know
nothing of engines, ranks or messages, and the controller must not import this module (torch).
Conventions follow verl's `core_algos`: tensors are [batch, response_len], masks are 0/1, losses
are minimised.

Global normalisation. With data parallelism and gradient accumulation, a micro-batch mean is
not the mean over the whole step. Pass a `LossScale` (the step's global token and sequence
counts, and the data-parallel size) and `agg_loss` returns this micro-batch's *share*: summed
over micro-batches and averaged over ranks (as FSDP/ZeRO average gradients), the shares give
exactly the loss of one pass over the global batch. Without a LossScale it is a plain mean.
Option names and allowed values are declared in hfrt.wire.loss_options (torch-free).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from hfrt.wire.loss_options import AGG_MODES as AGG_MODES  # the aggregation modes agg_loss knows


@dataclass(frozen=True, slots=True)
class LossScale:
    """What one micro-batch needs to know to contribute its share of a global-batch loss.

    global_tokens: response tokens (mask sum) in the whole step's batch, over all dp ranks.
    global_seqs: sequences with at least one response token in the whole step's batch, over all
        dp ranks (rows whose mask is empty, such as equal-rows padding, do not count).
    dp_size: ranks whose gradients are averaged.
    """

    global_tokens: float
    global_seqs: float
    dp_size: int = 1


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` with every position where mask is 0 set to 0 (NaN or inf there included:
    `values * mask` would keep NaN)."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    masked = zero_masked(values, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where mask is 1 (a metric helper; 0 where the mask is empty)."""
    if dim is None:
        return masked_sum(values, mask) / mask.sum().clamp(min=1)
    return masked_sum(values, mask, dim) / mask.sum(dim=dim).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean / unit variance over masked positions (advantage whitening), with
    the unbiased variance as torch.var. Fewer than 2 valid positions is an error, as in verl:
    there is no variance to normalise by."""
    count = int(mask.bool().sum())
    if count < 2:
        raise ValueError(
            f"advantage whitening needs at least 2 response tokens in the batch, got {count}: "
            "send more rows or longer responses (GAE and REINFORCE++ whiten over the whole batch)"
        )
    mean = masked_mean(values, mask)
    var = masked_sum((values - mean) ** 2, mask) / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    scale: LossScale | None = None,
    norm_horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a [batch, len] loss matrix to a scalar, as verl's agg_loss.

    token-mean: mean over all response tokens (DAPO's global token normalisation); a batch with
        no response token gives 0 (with a LossScale a micro-batch of padding rows is legitimate).
    seq-mean-token-sum: per-sequence token sum, mean over sequences.
    seq-mean-token-mean: per-sequence token mean, mean over sequences (original GRPO).
        Both seq-mean modes count only sequences with at least one response token.
    seq-mean-token-sum-norm: sum over all response tokens divided by a constant horizon L (the
        padded response length, or `norm_horizon`), with no division by the number of sequences
        (Dr. GRPO, verl's definition): the loss grows with the batch.
    seq-mean-token-sum-norm-mean: the same divided by the number of sequences as well (hfrt's
        own), so the loss does not depend on the batch size.
    Masked positions are zeroed before summing: NaN or inf there never reaches the loss.
    scale: see the module docstring; None means this call sees the whole batch.
    """
    mask = mask.to(loss_mat.dtype)
    factor = scale.dp_size if scale else 1
    if mode == "token-mean":
        tokens = scale.global_tokens if scale else mask.sum().clamp(min=1)
        return masked_sum(loss_mat, mask) / tokens * factor
    horizon = norm_horizon or loss_mat.shape[-1]
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, mask) / horizon * factor
    counts = mask.sum(dim=-1)
    seqs = scale.global_seqs if scale else (counts > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).sum() / seqs * factor
    if mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_mat, mask, dim=-1) / counts.clamp(min=1)
        return per_seq.sum() / seqs * factor
    if mode == "seq-mean-token-sum-norm-mean":
        return masked_sum(loss_mat, mask) / (seqs * horizon) * factor
    raise ValueError(f"unknown loss aggregation mode {mode!r}; use one of {', '.join(AGG_MODES)}")


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Policy-loss settings (hfrt.wire.loss_options.ActorLoss documents each option).

    mode: vanilla | gspo | cispo | decoupled. clip_ratio_low / clip_ratio_high: the ratio is clipped to
        [1 - low, 1 + high] (DAPO's clip-higher uses high > low). clip_ratio_c: vanilla's
        dual-clip bound for negative advantages (Ye et al. 2020), > 1; None disables it.
    agg_mode / norm_horizon: loss aggregation (see agg_loss).
    tis_cap: truncated importance sampling cap against the sampler's log-probs (None: off); the
        decoupled mode's cap on the behaviour weight π_prox / π_behav (required there).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    agg_mode: str = "token-mean"
    mode: str = "vanilla"
    tis_cap: float | None = None
    norm_horizon: int | None = None


Metrics = dict[str, torch.Tensor]


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    scale: LossScale | None = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The policy loss of `config.mode`, optionally truncated-IS weighted → (loss, metrics).

    decoupled (decoupled PPO, Hilton et al. 2021, as AReaL uses it for stale rollouts): PPO's
    clipped ratio π_θ / π_prox against the proximal policy (`old_log_prob`: the trainer's own
    log-probs before this update), the whole term weighted by min(π_prox / π_behav, tis_cap),
    detached, with the behaviour policy's log-probs `rollout_log_probs` (what the rollout engine
    sampled with, possibly several versions old). Its value is vanilla's with tis_cap; the mode
    states the objective and refuses to run without the behaviour log-probs and the cap.

    Inputs that carry no gradient (old log-probs, advantages, rollout log-probs) are zeroed on
    masked positions first, so NaN there cannot reach the loss or its gradient."""
    old_log_prob, advantages = zero_masked(old_log_prob, mask), zero_masked(advantages, mask)
    losses_of = {"vanilla": vanilla_losses, "gspo": gspo_losses, "cispo": cispo_losses, "decoupled": vanilla_losses}
    if config.mode not in losses_of:
        raise ValueError(f"unknown policy_loss_mode {config.mode!r}; use one of {', '.join(losses_of)}")
    if config.mode == "decoupled" and (config.tis_cap is None or rollout_log_probs is None):
        raise ValueError(
            "policy_loss_mode decoupled needs the behaviour policy's log-probs (the rollout's rollout_log_probs "
            f"column) and tis_cap, the cap of the weight π_prox / π_behav (got tis_cap={config.tis_cap!r}, "
            f"rollout_log_probs {'given' if rollout_log_probs is not None else 'missing'})")
    losses, metrics = losses_of[config.mode](log_prob, old_log_prob, advantages, mask, config)
    if config.tis_cap is not None:
        if rollout_log_probs is None:
            raise ValueError("tis_cap needs the sampler's log-probs (the rollout's rollout_log_probs column)")
        behaviour = zero_masked(rollout_log_probs, mask)
        weights, tis_metrics = tis_weights(old_log_prob, behaviour, mask, config.tis_cap)
        losses = losses * weights
        metrics |= tis_metrics
        if config.mode == "decoupled":  # how far the proximal policy has moved from the sampler
            metrics["actor/behav_kl"] = masked_mean(behaviour - old_log_prob, mask).detach()
    return agg_loss(losses, mask, config.agg_mode, scale, config.norm_horizon), metrics


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-20.0, 20.0)


def vanilla_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate per token, asymmetric clip and optional dual clip."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    metrics = {
        "actor/ppo_kl": masked_mean(-log_ratio, mask).detach(),
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
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025) per token: s_i = exp(mean over sequence i's tokens of
    (logp − old)); the token-level ratio s_i,t = sg(s_i)·exp(logp − sg(logp)) has s_i's value
    and, summed over a sequence's tokens, s_i's gradient; clipped as PPO's ratio (no dual clip)."""
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=10.0))
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    metrics = {
        "actor/ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
    }
    return torch.maximum(unclipped, clipped), metrics


def cispo_losses(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1): −sg(clip(ratio, 1 − low, 1 + high))·A·logp — every token keeps a
    gradient, the importance weight is clipped and detached."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high).detach()
    metrics = {
        "actor/ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "actor/pg_clipfrac": masked_mean((ratio != weight).float(), mask).detach(),
    }
    return -weight * advantages * log_prob, metrics


def tis_weights(
    old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance sampling between the trainer's and the sampler's probabilities:
    min(exp(old − rollout), cap), detached; metrics: the mean weight and the share truncated."""
    raw = torch.exp((old_log_prob - rollout_log_probs).detach().clamp(-20.0, 20.0))
    weights = raw.clamp(max=cap)
    metrics = {
        "actor/tis_weight_mean": masked_mean(weights, mask).detach(),
        "actor/tis_truncated_frac": masked_mean((raw > cap).float(), mask).detach(),
    }
    return weights, metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    scale: LossScale | None = None,
    norm_horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 × max(unclipped, clipped) squared error, with the prediction clipped around old values
    (returns and old values are zeroed on masked positions first, as policy_loss's inputs)."""
    returns, old_values = zero_masked(returns, mask), zero_masked(old_values, mask)
    losses = (values - returns) ** 2
    metrics: dict[str, torch.Tensor] = {}
    if clip_range is not None:
        clipped_pred = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped_losses = (clipped_pred - returns) ** 2
        metrics["critic/vf_clipfrac"] = masked_mean((clipped_losses > losses).float(), mask).detach()
        losses = torch.maximum(losses, clipped_losses)
    return 0.5 * agg_loss(losses, mask, agg_mode, scale, norm_horizon), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between policy and reference (Schulman's k1 / k2 / k3 estimators).

    kind: "kl"/"k1" (log ratio), "abs", "mse"/"k2" (half squared log ratio), "low_var_kl"/"k3"
    (exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10] as verl does).
    """
    diff = log_prob - ref_log_prob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        back = (-diff).clamp(-20.0, 20.0)
        return (back.exp() - back - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL penalty {kind!r}; use k1, abs, k2 or k3 (kl, mse, low_var_kl)")


# ------------------------------------------------------------------------------ advantages
#
# Advantage estimators on [batch, response_len] tensors, each returning (advantages, returns).
# Conventions follow verl's core_algos so numbers are comparable: outcome estimators score a
# sequence by the sum of its token rewards, group statistics are keyed by `index` (a prompt's uid),
# and whitening uses the masked mean and the unbiased masked variance.


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE by a reverse scan; `nextvalues` and `lastgaelam` are carried unchanged through masked
    positions. returns = advantages + values (before whitening); advantages are then whitened."""
    mask = response_mask.to(values.dtype)
    next_values = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    with torch.no_grad():
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            gae = delta + gamma * lam * last_gae
            next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
            last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
            reversed_adv.append(last_gae)
        advantages = torch.stack(reversed_adv[::-1], dim=1)
        returns = advantages + values
        return masked_whiten(advantages, mask), returns


def _group_scores(scores: torch.Tensor, index: Sequence[Hashable]) -> dict[Hashable, torch.Tensor]:
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} entries for {scores.shape[0]} rows")
    groups: dict[Hashable, list[int]] = {}
    for row, key in enumerate(index):
        groups.setdefault(key, []).append(row)
    return {key: scores[rows] for key, rows in groups.items()}


def _group_mean_std(scores: torch.Tensor, index: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and unbiased std of the row's group; a group of one has mean 0 and std 1."""
    stats = {}
    for key, group in _group_scores(scores, index).items():
        stats[key] = (group.mean(), group.std()) if len(group) > 1 else (scores.new_tensor(0.0), scores.new_tensor(1.0))
    mean = torch.stack([stats[key][0] for key in index])
    std = torch.stack([stats[key][1] for key in index])
    return mean, std


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (s − group mean) / (group std + epsilon), or s − group mean (Dr.GRPO), broadcast
    over the response mask; advantages and returns are the same tensor."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        mean, std = _group_mean_std(scores, index)
        centred = scores - mean
        adv = centred / (std + epsilon) if norm_adv_by_std else centred
        out = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
        return out, out


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: s·n/(n−1) − mean·n/(n−1) with the group of n (a group of one keeps its score)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        groups = _group_scores(scores, index)
        adv = scores.clone()
        for row, key in enumerate(index):
            n = len(groups[key])
            if n > 1:
                adv[row] = (scores[row] - groups[key].mean()) * n / (n - 1)
        out = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
        return out, out


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: the discounted return of each token (reset after the response ends),
    whitened over the batch's response tokens; returns are the unwhitened returns."""
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * mask[:, t]
        return masked_whiten(returns, mask) * mask, returns


def compute_reinforce_pp_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable]
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: s − group mean over the response, then whitened over the batch."""
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        mean, _ = _group_mean_std(scores, index)
        centred = (scores - mean).unsqueeze(-1) * mask
        out = masked_whiten(centred, mask) * mask
        return out, out


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy baseline's reward; returns are the reward-to-go."""
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        return returns - reward_baselines.unsqueeze(-1) * mask, returns


# ----------------------------------------------------------------------------- in-reward KL


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
