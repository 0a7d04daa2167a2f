"""On-policy distillation's advantage: the student samples, a teacher scores every sampled token,
and each token's signal is the teacher's log-prob of it minus the student's — the negative
per-token reverse KL, log π_T(y_t | y_<t) − log π_θ(y_t | y_<t) — optionally plus a weight times
the sequence's task score at every token. With a policy-gradient loss on these advantages the
student moves towards what the teacher would have said at each token it actually produced.

A baseline (on by default) subtracts, at each response position, the signal's mean over the
batch's rows: the expected gradient stays (up to the sample's own share of the mean) and its
variance drops — a student far from its teacher finds nearly every sampled token worse than the
teacher would have it, and without a baseline most of each step goes into pushing every sampled
token down alike (docs/pipeline.md).

Pure torch, no gradients; it knows nothing of batches, columns or daemons (the actor's advantage
component reads those).
"""

from __future__ import annotations

import torch


def compute_on_policy_distill_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    reward_coef: float = 0.0,
    baseline: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, R]: teacher − student log-prob per response token, plus
    reward_coef × the sequence's summed token rewards at each of its tokens, less (with
    `baseline`) each position's mean over the rows that have a token there; returns = advantages
    (no discounting: each token's signal is its own)."""
    with torch.no_grad():
        mask = response_mask.to(teacher_log_probs.dtype)
        advantages = (teacher_log_probs - student_log_probs) * mask
        if reward_coef:
            scores = (token_level_rewards * mask).sum(dim=-1, keepdim=True)
            advantages = advantages + reward_coef * scores * mask
        if baseline:
            mean = advantages.sum(dim=0, keepdim=True) / mask.sum(dim=0, keepdim=True).clamp(min=1)
            advantages = (advantages - mean) * mask
        return advantages, advantages
