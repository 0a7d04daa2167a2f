"""PPO-family math on [batch, response_len] tensors, under one name: loss arithmetic and
aggregation (core), the policy losses by name (policy, policy_cov), rollout correction
(corrections), advantage estimators (advantages, token_baseline) and in-reward KL (kl_control).

Pure torch functions, run daemon-side inside a training engine's loss function or the actor's
advantage component. They know nothing of engines, ranks or messages, and the controller must not
import this package (torch). Conventions and numbers follow verl's `core_algos` and its
rollout_corr_helper; docs/roles-and-losses.md lists each mode and estimator. Option names and
allowed values are declared in hfrt.wire.loss_options (torch-free).
"""

from __future__ import annotations

from hfrt.roles.losses.advantages import (
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from hfrt.roles.losses.core import (
    AGG_MODES,
    LossScale,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_whiten,
    seq_share,
    value_loss,
    zero_masked,
)
from hfrt.roles.losses.corrections import RolloutCorrection, rollout_correction, tis_weights
from hfrt.roles.losses.kl_control import AdaptiveKLController, FixedKLController, apply_kl_penalty
from hfrt.roles.losses.policy import PolicyLossConfig, policy_loss
from hfrt.roles.losses.token_baseline import (
    compute_optimal_token_baseline_advantage,
    compute_tir_optimal_token_baseline_advantage,
)

__all__ = [
    "AGG_MODES", "AdaptiveKLController", "FixedKLController", "LossScale", "PolicyLossConfig", "RolloutCorrection",
    "agg_loss", "apply_kl_penalty", "compute_gae_advantage_return", "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage", "compute_grpo_passk_outcome_advantage", "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_pp_baseline_advantage", "compute_remax_outcome_advantage", "compute_rloo_outcome_advantage",
    "compute_tir_optimal_token_baseline_advantage", "entropy_from_logits", "kl_penalty", "masked_mean",
    "masked_sum", "masked_whiten", "policy_loss", "rollout_correction", "seq_share", "tis_weights", "value_loss",
    "zero_masked",
]
