"""The loss arithmetic every role's loss shares, on [batch, response_len] tensors: masked sums and
means, whitening, loss aggregation (verl's agg_loss modes) with global normalisation, the value
loss, entropy and the per-token KL estimators.

Pure torch functions, run daemon-side inside a training engine's loss function. They know
nothing of engines, ranks or messages, nor of which policy loss or estimator uses them.
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



def seq_share(per_seq: torch.Tensor, mask: torch.Tensor, scale: LossScale | None = None) -> torch.Tensor:
    """The mean over sequences with at least one response token of a per-sequence loss [B],
    as this micro-batch's share of the global mini-batch (see LossScale)."""
    valid = mask.sum(dim=-1) > 0
    seqs = scale.global_seqs if scale else valid.sum().clamp(min=1)
    return zero_masked(per_seq, valid).sum() / seqs * (scale.dp_size if scale else 1)


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
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):  # a vocabulary-sharded head (tp loss_parallel)
        from hfrt.roles.training.parallel import vocab

        return vocab.entropy(logits)
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

