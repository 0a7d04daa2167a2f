"""Rollout correction between the trainer's and the sampler's probabilities, as verl's
rollout_corr_helper defines it: truncated importance weights per token or per sequence (optionally
divided by their batch mean), rejection masks for tokens / sequences whose divergence statistic is
out of bounds (verl's rollout_rs, "MIS"; IcePop's token masking is `token_k1`), the off-policy
diagnostics (KL, perplexities, χ²) and hfrt's older truncated-IS weight (`tis_weights`).

Pure torch on [batch, response_len] tensors; every weight is detached. It knows nothing of
engines or of which loss uses the weights; a cross-rank mean comes in as a `reduce` callable.
Metric names are verl's (`rollout_corr/...`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hfrt.roles.losses.core import masked_mean, masked_sum
from hfrt.wire.loss_options import rs_thresholds

#: exp(±20): the bound log-ratios are clamped to before exponentiating (verl's SAFETY_BOUND)
SAFETY_BOUND = 20.0
Metrics = dict[str, float]
#: sums a list of floats over the ranks of the group (identity without one)
Reduce = Callable[[Sequence[float]], list[float]]


@dataclass(frozen=True, slots=True)
class RolloutCorrection:
    """verl's RolloutCorrectionConfig fields (hfrt.wire.loss_options.ActorLoss documents them)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None

    @property
    def active(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


def tis_weights(
    old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """hfrt's truncated importance sampling (`tis_cap`): min(exp(old − rollout), cap), detached;
    metrics: the mean weight and the share truncated."""
    raw = torch.exp((old_log_prob - rollout_log_probs).detach().clamp(-20.0, 20.0))
    weights = raw.clamp(max=cap)
    metrics = {
        "actor/tis_weight_mean": masked_mean(weights, mask).detach(),
        "actor/tis_truncated_frac": masked_mean((raw > cap).float(), mask).detach(),
    }
    return weights, metrics


def _local(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values]


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
    batch_normalize: bool = False, reduce: Reduce = _local,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance weights exp(log_ratio) per token, or exp(Σ_t log_ratio) per sequence
    broadcast over its tokens; 0 where masked, truncated at `threshold`, detached; with
    batch_normalize divided by their mean (over tokens, or over sequences; `reduce` makes it the
    mean over every rank's rows). Metrics are computed before truncation, as verl does."""
    mask = mask.to(log_ratio.dtype)
    log_ratio = log_ratio.detach()
    if level == "token":
        seq_log = None
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        seq_log = masked_sum(log_ratio, mask, dim=-1)
        weights = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is={level!r}: use token or sequence")
    weights = weights * mask
    metrics = _is_metrics(weights, seq_log, mask, threshold)
    weights = weights.clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            total, count = reduce([float(masked_sum(weights, mask)), float(mask.sum())])
        else:
            valid = mask.sum(-1) > 0
            total, count = reduce([float(masked_mean(weights, mask, dim=-1)[valid].sum()), float(valid.sum())])
        mean = total / max(count, 1e-8)
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return weights, metrics


def _is_metrics(weights: torch.Tensor, seq_log: torch.Tensor | None, mask: torch.Tensor, threshold: float) -> Metrics:
    """verl's compute_is_metrics on the untruncated (masked) weights."""
    lower = 1.0 / threshold
    keep = mask.bool()
    valid = keep.any(dim=-1)
    m: Metrics = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if seq_log is not None:
        rows = seq_log[valid]
        m["rollout_is_max"] = math.exp(min(float(rows.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(rows.min()))
        m["rollout_is_ratio_fraction_high"] = float((rows > math.log(threshold)).float().mean())
        m["rollout_is_ratio_fraction_low"] = float((rows < math.log(lower)).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = float(masked_mean((weights > threshold).float(), mask))
        m["rollout_is_ratio_fraction_low"] = float(masked_mean((weights < lower).float(), mask))
        m["rollout_is_max"] = float(weights[keep].max())
        m["rollout_is_min"] = float(weights[keep].min())
    clamped = weights.clamp(lower, threshold)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped.square(), mask) - mean.square()
    m["rollout_is_std"] = float(var.clamp(min=0).sqrt()) if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean((clamped / (mean + 1e-8)).square(), mask))
    per_seq = masked_mean(weights, mask, dim=-1)[valid]
    m["rollout_is_seq_mean"] = float(per_seq.mean())
    m["rollout_is_seq_std"] = float(per_seq.std()) if per_seq.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = float(per_seq.max())
    m["rollout_is_seq_min"] = float(per_seq.min())
    m["rollout_is_seq_max_deviation"] = float((per_seq - 1.0).abs().max())
    m["rollout_is_seq_fraction_high"] = float((per_seq > threshold).float().mean())
    m["rollout_is_seq_fraction_low"] = float((per_seq < lower).float().mean())
    return m


def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str, threshold: str | float | None
) -> tuple[torch.Tensor, Metrics]:
    """The response mask with rejected tokens / sequences set to 0, and the rejection metrics.

    Per token, with r = π_train / π_rollout: k1 = −log r, k2 = ½(log r)², k3 = r − 1 − log r.
    token_kN bounds the token's statistic; seq_sum / seq_mean / seq_max bound the sequence's sum /
    mean / max of it and reject the whole sequence. k1 options keep log(lower) ≤ stat ≤ log(upper)
    — note the statistic is −log r, so "lower_upper" bounds π_rollout / π_train (verl's
    convention; with the default lower = 1/upper the two readings agree); k2 / k3 keep stat ≤ upper.
    Every option must pass."""
    mask = mask.to(log_ratio.dtype)
    keep_mask = mask.bool()
    valid = keep_mask.any(dim=-1)
    safe = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    combined = torch.ones_like(mask)
    metrics: Metrics = {}
    for option, lower, upper in rs_thresholds(rollout_rs, threshold):
        kind = option[-2:]
        lo = math.log(lower) if lower is not None else None
        hi = math.log(upper) if kind == "k1" else upper
        stat = per_token[kind]
        if option.startswith("token"):
            seq_stat = None
        elif option.startswith("seq_sum"):
            seq_stat = masked_sum(stat, mask, dim=-1)
        elif option.startswith("seq_mean"):
            seq_stat = masked_mean(stat, mask, dim=-1)
        else:
            seq_stat = _seq_max(stat, mask)
        judged = stat if seq_stat is None else seq_stat.unsqueeze(-1).expand_as(mask)
        keep = judged <= hi
        if lo is not None:
            keep = keep & (judged >= lo)
        metrics |= _rs_metrics(f"rollout_rs_{option}", judged, seq_stat, mask, lo if kind == "k1" else None, hi)
        token_keep = keep.to(mask.dtype)
        combined = combined * token_keep
        seq_keep = (~(~keep & keep_mask)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean(1 - token_keep, mask))
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = float((~seq_keep[valid]).float().mean()) if valid.any() else 0.0
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - combined, mask))
    metrics["rollout_rs_seq_masked_fraction"] = float(((combined < 0.5) & keep_mask).any(dim=-1).float().mean())
    return mask * combined, metrics


def _rs_metrics(
    prefix: str, stat: torch.Tensor, seq_stat: torch.Tensor | None, mask: torch.Tensor, lo: float | None, hi: float
) -> Metrics:
    """verl's compute_rs_metrics for one option (lo None: no lower bound)."""
    keep = mask.bool()
    valid = keep.any(dim=-1)
    seqs = (seq_stat if seq_stat is not None else masked_mean(stat, mask, dim=-1))[valid]
    low = lo if lo is not None else 0.0
    m: Metrics = {f"{prefix}_mean": float(masked_mean(stat, mask))}
    if seq_stat is not None and seqs.numel():
        m[f"{prefix}_max"], m[f"{prefix}_min"] = float(seqs.max()), float(seqs.min())
        m[f"{prefix}_fraction_high"] = float((seqs > hi).float().mean())
        m[f"{prefix}_fraction_low"] = float((seqs < low).float().mean()) if lo is not None else 0.0
    else:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = float(stat[keep].max()), float(stat[keep].min())
        m[f"{prefix}_fraction_high"] = float(masked_mean((stat > hi).float(), mask))
        m[f"{prefix}_fraction_low"] = float(masked_mean((stat < low).float(), mask)) if lo is not None else 0.0
    clamped = stat.clamp(min=low, max=hi)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped.square(), mask) - mean.square()
    m[f"{prefix}_std"] = float(var.clamp(min=0).sqrt()) if mask.sum() > 1 else 0.0
    m[f"{prefix}_seq_mean"] = float(seqs.mean())
    m[f"{prefix}_seq_std"] = float(seqs.std()) if seqs.numel() > 1 else 0.0
    m[f"{prefix}_seq_max"], m[f"{prefix}_seq_min"] = float(seqs.max()), float(seqs.min())
    m[f"{prefix}_seq_max_deviation"] = float(seqs.abs().max())
    m[f"{prefix}_seq_fraction_high"] = float((seqs > hi).float().mean())
    if lo is not None:
        m[f"{prefix}_seq_fraction_low"] = float((seqs < lo).float().mean())
    return m


def offpolicy_metrics(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """verl's off-policy diagnostics between trainer and sampler: KL(rollout ‖ train) by k1 and k3,
    both perplexities (mean of per-sequence values), their log difference and ratio, and the χ²
    divergence per token and per sequence (E[ρ²] − 1)."""
    mask = mask.to(train_log_prob.dtype)
    valid = mask.bool().any(dim=-1)
    train, rollout = train_log_prob.detach(), rollout_log_prob.detach()
    train_seq = masked_mean(train, mask, dim=-1)[valid]
    rollout_seq = masked_mean(rollout, mask, dim=-1)[valid]
    log_ratio = train - rollout
    diff = rollout_seq - train_seq
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_sum = masked_sum(log_ratio, mask, dim=-1)[valid].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-train_seq).mean()),
        "training_log_ppl": float((-train_seq).mean()),
        "kl": float(masked_mean(rollout - train, mask)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "rollout_ppl": float(torch.exp(-rollout_seq).mean()),
        "rollout_log_ppl": float((-rollout_seq).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(masked_mean(rho.square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_sum).mean() - 1.0),
    }


def rollout_correction(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
    config: RolloutCorrection, reduce: Reduce = _local,
) -> tuple[torch.Tensor | None, torch.Tensor, Metrics]:
    """(IS weights or None, the response mask after rejection, `rollout_corr/...` metrics) of the
    trainer's log-probs against the sampler's: verl's compute_rollout_correction_and_rejection_mask."""
    if not mask.bool().any():
        return None, mask, {}
    log_ratio = (train_log_prob - rollout_log_prob).detach()
    metrics: Metrics = {}
    weights = None
    if config.rollout_is is not None:
        weights, is_metrics = is_weights(
            log_ratio, mask, config.rollout_is, config.rollout_is_threshold, config.rollout_is_batch_normalize, reduce)
        metrics |= is_metrics
    kept = mask
    if config.rollout_rs is not None:
        kept, rs_metrics = rejection_mask(log_ratio, mask, config.rollout_rs, config.rollout_rs_threshold)
        kept = kept.to(mask.dtype)
        metrics |= rs_metrics
    metrics |= offpolicy_metrics(train_log_prob, rollout_log_prob, mask)
    return weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}
