"""Advantage estimators on [batch, response_len] tensors, each returning (advantages, returns),
with verl's definitions and numbers: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (and its
baseline variant), ReMax, OPO, GRPO pass@k and GPG; the optimal token baselines live in
hfrt.roles.losses.token_baseline.

Conventions follow verl's core_algos so numbers are comparable: outcome estimators score a
sequence by the sum of its token rewards, group statistics are keyed by `index` (a prompt's uid),
and whitening uses the masked mean and the unbiased masked variance. Pure torch, no gradients; it
knows nothing of batches, columns or daemons (hfrt.roles.components.advantage reads those).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from hfrt.roles.losses.core import masked_whiten


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


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable]
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): s − b with the length-weighted group baseline b = Σ l_j s_j / Σ l_j
    (l: response lengths); a group of one has baseline 0."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        baseline = torch.zeros_like(scores)
        for rows in _group_rows(index, scores.shape[0]).values():
            if len(rows) > 1:
                baseline[rows] = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
        out = (scores - baseline).unsqueeze(-1) * response_mask.to(scores.dtype)
        return out, out


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO pass@k (Chen et al. 2025): only the best sample of each group gets an advantage,
    r_max − r_second (÷ (group std + epsilon) with norm_adv_by_std); every group needs ≥ 2
    samples. Ties go to the first best sample (torch.topk on the group, as verl)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.zeros_like(scores)
        for key, rows in _group_rows(index, scores.shape[0]).items():
            group = scores[rows]
            if group.numel() < 2:
                raise ValueError(f"grpo_passk needs at least 2 samples per group; group {key!r} has {group.numel()}")
            top, where = torch.topk(group, 2)
            value = top[0] - top[1]
            adv[rows[int(where[0])]] = value / (group.std() + epsilon) if norm_adv_by_std else value
        out = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
        return out, out


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable], f_norm: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): α·(s − group mean) / f_norm with α = B / (rows whose score is not
    0, at least 1): the batch's share of rows with a non-zero score corrects the gradient for
    groups with nothing to learn. A group of one has mean 0."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
        mean, _ = _group_mean_std(scores, index)
        out = (alpha * (scores - mean) / f_norm).unsqueeze(-1) * response_mask.to(scores.dtype)
        return out, out


def _group_rows(index: Sequence[Hashable], rows: int) -> dict[Hashable, list[int]]:
    if len(index) != rows:
        raise ValueError(f"index has {len(index)} entries for {rows} rows")
    groups: dict[Hashable, list[int]] = {}
    for row, key in enumerate(index):
        groups.setdefault(key, []).append(row)
    return groups
