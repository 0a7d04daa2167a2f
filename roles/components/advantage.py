"""Advantage computation for a role endpoint: a component the actor daemon holds (`Advantages`),
whose `compute` runs on rank 0 of the role over the whole batch — small [B, R] columns — so
batch-wide statistics (whitening, group means over prompts split across ranks) are exact, and the
controller never sees a tensor.

It knows the estimators of hfrt.roles.losses and the column names of a rollout; it knows nothing of
the daemon that holds it, of engines or of the flow that calls it. The in-reward KL controller is
the one piece of state: made on the first call that asks for it, updated on every such call.

Before the estimator the scores may be shaped, each at the last response token: a cost column
weighted by −cost_coef (Safe-RLHF's Lagrangian reward, the flow owns λ) and DAPO's soft overlong
penalty on the response length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.common import build_dataclass
from hfrt.roles.losses import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_tir_optimal_token_baseline_advantage,
    kl_penalty,
    masked_mean,
)
from hfrt.roles.losses.corrections import is_weights
from hfrt.roles.losses.distill import compute_on_policy_distill_advantage
from hfrt.roles.reward_fns import token_level_rewards
from hfrt.roles.rows import merge, take
from hfrt.wire.loss_options import ESTIMATORS as ESTIMATORS  # declared torch-free, checked before launch


@dataclass(frozen=True)
class AdvantageParams:
    """Keyword options of `compute_advantages`.

    gamma / lam: discount and GAE λ. norm_adv_by_std: GRPO (True) or Dr.GRPO (False); epsilon:
    GRPO's std guard. use_kl_in_reward: rewards = scores − β·KL(old ‖ ref) of type kl_penalty, β from
    a `kl_ctrl` controller ("fixed": kl_coef; "adaptive": starts at kl_coef, aims at target_kl over
    horizon samples). score_column: the token-level scores; index_column: the group key (a prompt's
    uid); baseline_column: ReMax's per-row baseline reward (a non-tensor or [B] tensor column).
    cost_column / cost_coef: rewards = scores − cost_coef·costs, costs the token-level column
    cost_column ("" : none; Safe-RLHF's reward − λ·cost, λ given per call as cost_coef).
    overlong_buffer_len L / overlong_penalty_factor / max_response_len M (0: the response width):
    a response of length l > M − L gets −(l − (M − L))/L·factor added to its score (DAPO; L 0: off).
    f_norm: GPG's divisor. The optimal token baselines read the old policy's log-probs
    (`old_log_probs`, else `rollout_log_probs`), Σπ² per token (sum_pi_squared_column, from
    actor.compute_log_prob(sum_pi_squared=True)) and, when the batch has it, `rollout_is_weights`,
    else with rollout_is ("token" | "sequence") the truncated weights π_old / π_rollout at
    rollout_is_threshold (from `old_log_probs` and `rollout_log_probs`; verl's decoupled-mode
    weights); handle_zero_tail: None is verl's default (False for optimal_token_baseline, True for tir_...).
    on_policy_distill reads the teacher's per-token log-probs (teacher_column: a reference
    implementation's compute_log_prob of the rollout) against the student's (`old_log_probs`, else
    the sampler's `rollout_log_probs`), plus distill_reward_coef × each sequence's score, less each
    response position's batch mean with distill_baseline (hfrt.roles.losses.distill).
    """

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    epsilon: float = 1e-6
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: float = 10000.0
    score_column: str = "token_level_scores"
    index_column: str = "uid"
    baseline_column: str = "baseline_score"
    cost_column: str = ""
    cost_coef: float = 0.0
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    max_response_len: int = 0
    f_norm: float = 1.0
    sum_pi_squared_column: str = "sum_pi_squared"
    handle_zero_tail: bool | None = None
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    teacher_column: str = "ref_log_prob"
    distill_reward_coef: float = 0.0
    distill_baseline: bool = True


def make_kl_controller(p: AdvantageParams) -> FixedKLController | AdaptiveKLController:
    if p.kl_ctrl == "fixed":
        return FixedKLController(p.kl_coef)
    if p.kl_ctrl == "adaptive":
        return AdaptiveKLController(p.kl_coef, p.target_kl, p.horizon)
    raise ValueError(f"unknown kl_ctrl {p.kl_ctrl!r}: use fixed or adaptive")


def estimate(
    estimator: str, rewards: torch.Tensor, mask: torch.Tensor, batch: Batch, p: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of one estimator, reading what else it needs from `batch`."""
    if estimator == "gae":
        values = take(batch, ["values"], "compute_advantages(gae)")["values"].float()
        return compute_gae_advantage_return(rewards, values, mask, p.gamma, p.lam)
    if estimator == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_outcome_advantage(rewards, mask, p.gamma)
    if estimator == "remax":
        return compute_remax_outcome_advantage(rewards, _column(batch, p.baseline_column), mask)
    if estimator == "on_policy_distill":
        return _distill(rewards, mask, batch, p)
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")
    index = list(_non_tensor(batch, p.index_column))
    if estimator == "grpo":
        return compute_grpo_outcome_advantage(rewards, mask, index, p.epsilon, p.norm_adv_by_std)
    if estimator == "rloo":
        return compute_rloo_outcome_advantage(rewards, mask, index)
    if estimator == "reinforce_plus_plus_baseline":
        return compute_reinforce_pp_baseline_advantage(rewards, mask, index)
    if estimator == "opo":
        return compute_opo_outcome_advantage(rewards, mask, index)
    if estimator == "grpo_passk":
        return compute_grpo_passk_outcome_advantage(rewards, mask, index, p.epsilon, p.norm_adv_by_std)
    if estimator == "gpg":
        return compute_gpg_outcome_advantage(rewards, mask, index, p.f_norm)
    if estimator in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        return _token_baseline(estimator, rewards, mask, index, batch, p)
    raise ValueError(f"unknown advantage estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")


def _token_baseline(
    estimator: str, rewards: torch.Tensor, mask: torch.Tensor, index: list[Any], batch: Batch, p: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB / TIR-OTB with the columns they read (see AdvantageParams)."""
    old_name = "old_log_probs" if "old_log_probs" in batch.tensors else "rollout_log_probs"
    where = f"compute_advantages({estimator})"
    if p.sum_pi_squared_column not in batch.tensors:
        raise KeyError(f"{where} needs a {p.sum_pi_squared_column!r} column (Σπ² per token): pass the batch of "
                       f"actor.compute_log_prob(rollout, sum_pi_squared=True); the batch has {batch.keys()}")
    cols = take(batch, [old_name, p.sum_pi_squared_column], where)
    weights = batch.tensors.get("rollout_is_weights")
    if weights is None and p.rollout_is is not None:
        logp = take(batch, ["old_log_probs", "rollout_log_probs"], f"{where} with rollout_is")
        weights, _ = is_weights(logp["old_log_probs"].float() - logp["rollout_log_probs"].float(), mask, p.rollout_is,
                                p.rollout_is_threshold)
    fn = compute_optimal_token_baseline_advantage if estimator == "optimal_token_baseline" else compute_tir_optimal_token_baseline_advantage
    zero_tail = p.handle_zero_tail if p.handle_zero_tail is not None else estimator.startswith("tir")
    return fn(rewards, mask, index, cols[old_name].float(), cols[p.sum_pi_squared_column].float(),
              None if weights is None else weights.float(), zero_tail)


def _distill(rewards: torch.Tensor, mask: torch.Tensor, batch: Batch, p: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation's advantages with the columns they read (see AdvantageParams)."""
    student = "old_log_probs" if "old_log_probs" in batch.tensors else "rollout_log_probs"
    cols = take(batch, [p.teacher_column, student], "compute_advantages(on_policy_distill)")
    return compute_on_policy_distill_advantage(
        rewards, mask, cols[p.teacher_column].float(), cols[student].float(), p.distill_reward_coef, p.distill_baseline)


def _non_tensor(batch: Batch, name: str) -> list[Any]:
    if name not in batch.non_tensor:
        raise KeyError(f"compute_advantages needs a non-tensor column {name!r}; the batch has {batch.keys()}")
    return list(batch.non_tensor[name])


def _column(batch: Batch, name: str) -> torch.Tensor:
    if name in batch.tensors:
        return batch.tensors[name].float().reshape(-1)
    return torch.tensor([float(v) for v in _non_tensor(batch, name)])


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per response: 0 up to max_len − buffer_len tokens, then
    falling linearly to −factor at max_len: −(length − (max_len − buffer_len)) / buffer_len · factor."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong_buffer_len must be in (0, max_response_len={max_len}], got {buffer_len}")
    exceed = lengths.float() - (max_len - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)


def shape_scores(batch: Batch, scores: torch.Tensor, mask: torch.Tensor, p: AdvantageParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores minus cost_coef × the cost column, plus the overlong penalty at each last response
    token (see AdvantageParams); each with its metrics. Unchanged when neither is asked for."""
    metrics: dict[str, float] = {}
    if p.cost_column:
        costs = take(batch, [p.cost_column], "compute_advantages(cost_column)")[p.cost_column].float()
        scores = scores - p.cost_coef * costs
        metrics["cost/token_sum_mean"] = float((costs * mask).sum(-1).mean())
    if p.overlong_buffer_len:
        penalty = overlong_penalty(mask.sum(-1), p.max_response_len or mask.shape[1], p.overlong_buffer_len, p.overlong_penalty_factor)
        scores = scores + token_level_rewards(penalty, mask)
        metrics |= {"overlong/penalty_mean": float(penalty.mean()), "overlong/share": float((penalty < 0).float().mean())}
    return scores, metrics


def summary(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """{name/mean, name/max, name/min} over the masked positions (0s when nothing is masked in)."""
    picked = values[mask.bool()]
    if picked.numel() == 0:
        return {f"{name}/mean": 0.0, f"{name}/max": 0.0, f"{name}/min": 0.0}
    return {f"{name}/mean": float(picked.mean()), f"{name}/max": float(picked.max()), f"{name}/min": float(picked.min())}


class Advantages:
    """What the actor's RANK0 endpoints compute_advantages, advantage_state and
    load_advantage_state do, with the in-reward KL controller they share."""

    def __init__(self) -> None:
        self._kl_controller: FixedKLController | AdaptiveKLController | None = None

    def compute(self, batch: Batch, *extra: Batch, estimator: str = "gae", **params: Any) -> Batch:
        """`advantages`, `returns` and `token_level_rewards` [B, R] (0 where response_mask is 0)
        for the whole batch, by `estimator` (see ESTIMATORS; options: AdvantageParams). Meta
        `metrics`: advantage / return / reward stats, `kl/mean` when old and reference log-probs
        are present, and the in-reward KL coefficient when it is used."""
        merged = merge(batch, extra)
        p: AdvantageParams = build_dataclass(AdvantageParams, params, "compute_advantages")
        cols = take(merged, ["response_mask", p.score_column], "compute_advantages")
        mask, rewards = cols["response_mask"].float(), cols[p.score_column].float()
        rewards, metrics = shape_scores(merged, rewards, mask, p)
        old = merged.tensors.get("old_log_probs", merged.tensors.get("rollout_log_probs"))  # the sampler's: on-policy
        if old is not None and "ref_log_prob" in merged.tensors:
            kl = kl_penalty(old.float(), merged.tensors["ref_log_prob"].float(), p.kl_penalty)
            metrics["kl/mean"] = float(masked_mean(kl, mask))
        if p.use_kl_in_reward:
            rewards, metrics = self._kl_in_reward(merged, rewards, mask, p, metrics)
        advantages, returns = estimate(estimator, rewards, mask, merged, p)
        advantages, returns = advantages * mask, returns * mask
        metrics |= summary("advantages", advantages, mask) | summary("returns", returns, mask)
        metrics["reward/token_sum_mean"] = float((rewards * mask).sum(-1).mean())
        tensors = {"advantages": advantages, "returns": returns, "token_level_rewards": rewards * mask}
        return Batch(tensors, meta={"metrics": metrics})

    def state(self) -> dict[str, Any]:
        """The in-reward KL controller's state (for run checkpoints): {} before its first use."""
        ctrl = self._kl_controller
        if ctrl is None:
            return {}
        return {"kind": "adaptive" if isinstance(ctrl, AdaptiveKLController) else "fixed", "value": ctrl.value}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned; the controller's other settings come from the next
        call's options, its current coefficient from here."""
        if not state:
            self._kl_controller = None
            return
        kind = str(state["kind"])
        self._kl_controller = make_kl_controller(AdvantageParams(kl_ctrl=kind, kl_coef=float(state["value"])))
        self._kl_controller.value = float(state["value"])

    def _kl_in_reward(
        self, batch: Batch, scores: torch.Tensor, mask: torch.Tensor, p: AdvantageParams, metrics: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logp = take(batch, ["old_log_probs", "ref_log_prob"], "compute_advantages(use_kl_in_reward)")
        if self._kl_controller is None:
            self._kl_controller = make_kl_controller(p)
        elif isinstance(self._kl_controller, AdaptiveKLController) and p.kl_ctrl == "adaptive":
            self._kl_controller.target, self._kl_controller.horizon = p.target_kl, p.horizon
        beta = self._kl_controller.value
        rewards, current = apply_kl_penalty(scores, logp["old_log_probs"].float(), logp["ref_log_prob"].float(), mask, beta, p.kl_penalty)
        self._kl_controller.update(current, n_steps=len(batch))
        return rewards, metrics | {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}
