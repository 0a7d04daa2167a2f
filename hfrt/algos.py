"""PPO-family loss math on [batch, response_len] tensors: policy, value, entropy, KL, aggregation.

Pure torch functions, run daemon-side inside a training engine's loss function. They know
nothing of engines, ranks or messages, and the controller must not import this module (torch).
Conventions follow verl's `core_algos`: tensors are [batch, response_len], masks are 0/1, losses
are minimised.

Global normalisation. With data parallelism and gradient accumulation, a micro-batch mean is
not the mean over the whole step. Pass a `LossScale` (the step's global token and sequence
counts, and the data-parallel size) and `agg_loss` returns this micro-batch's *share*: summed
over micro-batches and averaged over ranks (as FSDP/ZeRO average gradients), the shares give
exactly the loss of one pass over the global batch. Without a LossScale it is a plain mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True, slots=True)
class LossScale:
    """What one micro-batch needs to know to contribute its share of a global-batch loss.

    global_tokens: response tokens (mask sum) in the whole step's batch, over all dp ranks.
    global_seqs: sequences in the whole step's batch, over all dp ranks.
    dp_size: ranks whose gradients are averaged.
    """

    global_tokens: float
    global_seqs: float
    dp_size: int = 1


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where mask is 1 (a metric helper; 0 where the mask is empty)."""
    if dim is None:
        return masked_sum(values, mask) / mask.sum().clamp(min=1)
    return masked_sum(values, mask, dim) / mask.sum(dim=dim).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean / unit variance over masked positions (advantage whitening)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if count > 1:
        var = var * count / (count - 1)  # unbiased, as torch.var
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    scale: LossScale | None = None,
    norm_horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a [batch, len] loss matrix to a scalar.

    token-mean: mean over all response tokens (DAPO's global token normalisation).
    seq-mean-token-sum: per-sequence token sum, mean over sequences.
    seq-mean-token-mean: per-sequence token mean, mean over sequences (original GRPO).
    seq-mean-token-sum-norm: per-sequence token sum divided by a constant horizon (default the
        padded response length, or `norm_horizon`), mean over sequences (Dr. GRPO). verl divides
        by the horizon only; dividing by the sequence count as well keeps the loss independent of
        batch size.
    scale: see the module docstring; None means this call sees the whole batch.
    """
    mask = mask.to(loss_mat.dtype)
    tokens = scale.global_tokens if scale else mask.sum().clamp(min=1)
    seqs = scale.global_seqs if scale else max(loss_mat.shape[0], 1)
    factor = scale.dp_size if scale else 1
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / tokens * factor
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).sum() / seqs * factor
    if mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_mat, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
        return per_seq.sum() / seqs * factor
    if mode == "seq-mean-token-sum-norm":
        horizon = norm_horizon or loss_mat.shape[-1]
        return masked_sum(loss_mat, mask) / (seqs * horizon) * factor
    raise ValueError(f"unknown loss aggregation mode {mode!r}; use one of {', '.join(AGG_MODES)}")


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Clipped-surrogate settings.

    clip_ratio_low / clip_ratio_high: the ratio is clipped to [1 - low, 1 + high] (DAPO's
        clip-higher uses high > low).
    clip_ratio_c: dual-clip bound for negative advantages (Ye et al. 2020); must exceed 1;
        None disables dual clip.
    agg_mode: loss aggregation (see agg_loss).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    agg_mode: str = "token-mean"


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip and optional dual clip → (loss, metrics)."""
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
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
    return agg_loss(losses, mask, config.agg_mode, scale), metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 × max(unclipped, clipped) squared error, with the prediction clipped around old values."""
    losses = (values - returns) ** 2
    metrics: dict[str, torch.Tensor] = {}
    if clip_range is not None:
        clipped_pred = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped_losses = (clipped_pred - returns) ** 2
        metrics["critic/vf_clipfrac"] = masked_mean((clipped_losses > losses).float(), mask).detach()
        losses = torch.maximum(losses, clipped_losses)
    return 0.5 * agg_loss(losses, mask, agg_mode, scale), metrics


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
