"""The preference (DPO-family) losses on sequence log-probs, with TRL's formulas and metric names.

Inputs per pair: the policy's and the reference's summed log-probs of the chosen and the rejected
completion, and each completion's token count (IPO averages over tokens). With Δ = (π_c − ref_c)
− (π_r − ref_r) (the log-ratio margin):
- sigmoid: −log σ(βΔ) (DPO); with label smoothing ε the conservative mix −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)
- ipo: (Δ̄ − 1/(2β))², Δ̄ on token-averaged log-ratios (IPO, normalised as TRL does)
- hinge: max(0, 1 − βΔ) (SLiC)
- robust: (−(1−ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε) (robust DPO; ε the flip rate)
Metrics: rewards/chosen and rewards/rejected (β × each side's log-ratio), rewards/accuracies
(chosen's reward above rejected's), rewards/margins, logps/chosen, logps/rejected.

Pure torch on [pairs] tensors; it knows nothing of engines, micro-batches or tokenisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hfrt.wire.loss_options import PreferenceLoss

#: the per-pair metrics preference_terms returns (summed over pairs, then divided by the pair count)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def preference_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    cfg: PreferenceLoss,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each pair's loss [pairs] by cfg.loss_type (see the module docstring); ipo needs the token counts."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    beta, eps = cfg.beta, cfg.label_smoothing
    if cfg.loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    if cfg.loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if cfg.loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if cfg.loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss averages each side's log-ratio over its tokens: pass chosen_tokens and rejected_tokens")
        averaged = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        return (averaged - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown preference loss_type {cfg.loss_type!r}")


def preference_terms(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float
) -> dict[str, torch.Tensor]:
    """The METRICS of each pair [pairs] (detached), TRL's definitions."""
    with torch.no_grad():
        reward_chosen, reward_rejected = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        return {
            "rewards/chosen": reward_chosen, "rewards/rejected": reward_rejected,
            "rewards/accuracies": (reward_chosen > reward_rejected).float(),
            "rewards/margins": reward_chosen - reward_rejected,
            "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach(),
        }
