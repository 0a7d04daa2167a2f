"""The optimal token baseline (OTB) estimators of verl: a per-timestep baseline for each prompt
group, B_t = Σ_i G_i,t·W_i,t / Σ_i W_i,t, where G is the reward-to-go and W_t = Σ_{j≤t} w_j the
cumulative path-variance proxy with w_j = 1 − 2π_j + Σ_v π_v² (π_j: the sampled token's
probability under the old policy; Σπ²: over the vocabulary, the `sum_pi_squared` column). The
TIR variant aligns each sequence's *response tokens* (skipping masked positions, e.g. tool output
in a multi-turn trajectory) before taking the baseline per aligned step.

Pure torch, no gradients; it knows nothing of batches or columns.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _path_weights(
    old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor | None
) -> torch.Tensor:
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if is_weights is not None:  # scaled by ρ̄² to minimise the MSE under truncated IS (verl)
        w = w * is_weights**2
    return (w * mask).cumsum(dim=-1)


def _groups(index: Sequence[Hashable], rows: int) -> dict[Hashable, list[int]]:
    if len(index) != rows:
        raise ValueError(f"index has {len(index)} entries for {rows} rows")
    out: dict[Hashable, list[int]] = {}
    for row, key in enumerate(index):
        out.setdefault(key, []).append(row)
    return out


def _zero_tail(baselines: torch.Tensor, lengths: torch.Tensor, rows: list[int]) -> None:
    """Where one sequence is longer than every other of its group, its baseline past the
    second-longest length is 0 (no other sample informs it)."""
    group = lengths[rows]
    ordered = torch.sort(group).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_max = (group == longest).nonzero(as_tuple=True)[0]
    if at_max.numel() == 1 and longest > second:
        baselines[rows[int(at_max[0])], second:] = 0.0


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB per position t of the padded response: A = (G − B_t)·mask, returns G. A group of one
    has baseline 0. rollout_is_weights (truncated IS weights) scale w by ρ̄²."""
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        w = _path_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
        baselines = torch.zeros_like(returns)
        lengths = mask.sum(dim=-1)
        for rows in _groups(index, returns.shape[0]).values():
            if len(rows) == 1:
                continue
            g, wg, mg = returns[rows], w[rows], mask[rows]
            step = (g * wg * mg).sum(dim=0) / ((wg * mg).sum(dim=0) + epsilon)
            baselines[rows] = step.unsqueeze(0).expand(len(rows), -1)
            if handle_zero_tail:
                _zero_tail(baselines, lengths, rows)
        return (returns - baselines) * mask, returns


def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TIR-OTB (verl's multi-turn OTB): each sequence's response tokens (mask 1) are packed to
    the left, the baseline is taken per packed step over the group, and the advantages are put
    back at the tokens' positions. Rows without a response token are left out; a group of one
    has baseline 0; handle_zero_tail defaults to True here, as in verl."""
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        w = _path_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
        lengths = mask.sum(dim=-1).long()
        width = int(lengths.max()) if lengths.numel() else 0
        packed_w = w.new_zeros(len(lengths), width)
        packed_g = torch.zeros_like(packed_w)
        keep = mask.bool()
        for i, length in enumerate(lengths.tolist()):
            if length:
                packed_w[i, :length], packed_g[i, :length] = w[i, keep[i]], returns[i, keep[i]]
        index = [key for key in index]
        rows_with_tokens = [i for i in range(len(lengths)) if lengths[i] > 0]
        groups = _groups([index[i] for i in rows_with_tokens], len(rows_with_tokens))
        baselines = torch.zeros_like(packed_g)
        for members in groups.values():
            rows = [rows_with_tokens[m] for m in members]
            if len(rows) == 1:
                continue
            step = (packed_g[rows] * packed_w[rows]).sum(dim=0) / (packed_w[rows].sum(dim=0) + epsilon)
            baselines[rows] = step.to(baselines.dtype)
            if handle_zero_tail:
                _zero_tail(baselines, lengths, rows)
        packed_adv = packed_g - baselines
        advantages = torch.zeros_like(returns)
        for i, length in enumerate(lengths.tolist()):
            if length:
                advantages[i, keep[i]] = packed_adv[i, :length]
        return advantages * mask, returns
