"""The actor's update objective from its `ActorLoss` options: the policy loss of its mode, the
rollout correction (importance weights, rejection), the entropy bonus and the KL loss, as the
`make_loss` that roles/training/updates.run_updates calls; and what an update reads and
prepares before its first step (`update_columns`, `prepare_corrections`).

Where the rollout correction is computed, as in verl:
- decoupled (old_log_probs given, bypass_mode off): once per update over the whole batch, before
  any step (old vs rollout log-probs do not change during the update): the weights become a
  `rollout_is_weights` column, rejected tokens leave `response_mask`, so every loss term and the
  global token counts skip them; batch normalisation is over every rank's rows.
- bypass_mode (old := rollout_log_probs) or no old_log_probs (on-policy, old := current): in each
  micro-batch's loss, from the current log-probs (detached) against the rollout's; rejected tokens
  are dropped from the policy loss only, batch normalisation is over the micro-batch.
It knows the loss functions and the column names; nothing of engines beyond LossFn, or of the wire.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from hfrt.roles.losses import (
    LossScale,
    PolicyLossConfig,
    RolloutCorrection,
    agg_loss,
    kl_penalty,
    policy_loss,
    rollout_correction,
    zero_masked,
)
from hfrt.roles.rows import all_reduce
from hfrt.roles.training.engines import ForwardOutput, LossFn
from hfrt.roles.training.updates import MakeLoss, accumulate, require_one_step
from hfrt.wire.loss_options import ActorLoss, UpdateSchedule

#: columns prepare_corrections adds (the loss reads them when present)
IS_WEIGHTS = "rollout_is_weights"


def policy_config(cfg: ActorLoss) -> PolicyLossConfig:
    """The policy-loss settings of an update's options."""
    return PolicyLossConfig(
        cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.loss_agg_mode, mode=cfg.policy_loss_mode,
        tis_cap=cfg.tis_cap, norm_horizon=cfg.norm_horizon, keep_loss_agg_mode=cfg.keep_loss_agg_mode,
        tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg, clip_cov_ratio=cfg.clip_cov_ratio, clip_cov_lb=cfg.clip_cov_lb,
        clip_cov_ub=cfg.clip_cov_ub, kl_cov_ratio=cfg.kl_cov_ratio, ppo_kl_coef=cfg.ppo_kl_coef,
    )


def correction_config(cfg: ActorLoss) -> RolloutCorrection:
    return RolloutCorrection(
        cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize, cfg.rollout_rs, cfg.rollout_rs_threshold)


def update_columns(cfg: ActorLoss, columns: set[str], schedule: UpdateSchedule, rows: int, endpoint: str) -> list[str]:
    """The columns an update with `cfg` reads besides the forward inputs. Without old_log_probs
    (and without bypass_mode, where the rollout's are the old ones) the update must be one
    optimizer step (require_one_step)."""
    with_old = "old_log_probs" in columns and not cfg.bypass_mode
    if not with_old and not cfg.bypass_mode:
        require_one_step(schedule, rows, endpoint)
    more = ["advantages"] + (["old_log_probs"] if with_old else []) + (["ref_log_prob"] if cfg.use_kl_loss else [])
    return more + (["rollout_log_probs"] if cfg.reads_rollout_log_probs else [])


def prepare_corrections(tensors: dict[str, torch.Tensor], cfg: ActorLoss) -> dict[str, float]:
    """Decoupled mode's rollout correction over this rank's rows, before the update (see the
    module docstring): adds `rollout_is_weights`, applies the rejection to `response_mask` (in
    place in `tensors`), and returns the `rollout_corr/...` metrics (means over ranks; exact on
    one rank). A no-op (no metrics) unless old_log_probs is given and bypass_mode is off."""
    corr = correction_config(cfg)
    if not corr.active or cfg.bypass_mode or "old_log_probs" not in tensors:
        return {}
    mask = tensors["response_mask"]
    [empty] = all_reduce([0.0 if mask.bool().any() else 1.0], "max")  # every rank decides alike (collectives follow)
    if empty:
        raise ValueError("actor.update: the rollout correction (rollout_is / rollout_rs) needs at least one response "
                         "token on every data-parallel rank; a rank got only empty responses")
    weights, kept, metrics = rollout_correction(
        tensors["old_log_probs"].float(), zero_masked(tensors["rollout_log_probs"].float(), mask), mask, corr,
        reduce=lambda values: all_reduce(values, "sum"))
    if weights is not None:
        tensors[IS_WEIGHTS] = weights
    tensors["response_mask"] = kept.to(mask.dtype)
    keys = sorted(metrics)
    [ranks] = all_reduce([1.0])
    return {k: v / ranks for k, v in zip(keys, all_reduce([metrics[k] for k in keys]), strict=True)}


def step_generator(cfg: ActorLoss, step: int) -> torch.Generator:
    """The generator of Clip-Cov's random pick in the update starting at optimizer step `step`:
    seeded by loss_seed and the step, so a run repeats and successive steps differ."""
    return torch.Generator().manual_seed(zlib.crc32(f"{cfg.loss_seed}:{step}".encode()))


def actor_loss(cfg: ActorLoss, step: int = 0) -> MakeLoss:
    """Policy loss of cfg.policy_loss_mode (rollout-corrected, TIS-weighted with tis_cap) − entropy
    bonus + KL loss, each term's share recorded. `step`: the optimizer step the update starts at."""
    policy = policy_config(cfg)
    corr = correction_config(cfg)
    generator = step_generator(cfg, step)

    def aggregate(mat: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
        return agg_loss(mat, mask, cfg.loss_agg_mode, scale, cfg.norm_horizon)

    def make(scale: LossScale, shares: dict[str, float]) -> LossFn:
        def loss_fn(out: ForwardOutput, mb: Any, _: LossScale) -> tuple[torch.Tensor, dict[str, Any]]:
            assert out.log_probs is not None
            mask = mb["response_mask"]
            old, weights, policy_mask, metrics = _old_and_correction(out.log_probs, mb, cfg, corr)
            loss, pg_metrics = policy_loss(
                out.log_probs, old, mb["advantages"], policy_mask, policy, scale,
                None if cfg.bypass_mode else mb.get("rollout_log_probs"), weights, generator,
            )
            metrics |= pg_metrics
            accumulate(shares, "actor/pg_loss", loss.detach())
            if cfg.entropy_coeff:
                assert out.entropy is not None
                entropy = aggregate(out.entropy, mask, scale)
                loss = loss - cfg.entropy_coeff * entropy
                accumulate(shares, "actor/entropy", entropy.detach())
            if cfg.use_kl_loss:
                kl = aggregate(kl_penalty(out.log_probs, zero_masked(mb["ref_log_prob"], mask), cfg.kl_loss_type), mask, scale)
                loss = loss + cfg.kl_loss_coef * kl
                accumulate(shares, "actor/kl_loss", kl.detach())
            return loss, metrics

        return loss_fn

    return make


def _old_and_correction(
    log_probs: torch.Tensor, mb: Any, cfg: ActorLoss, corr: RolloutCorrection
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[str, Any]]:
    """(old log-probs, correction weights or None, the policy loss's mask, metrics) of one
    micro-batch. Without an old_log_probs column the update is on-policy (one optimizer step per
    rollout), so the old log-probs are the current ones, detached (the ratio is exactly 1); in
    bypass mode they are the rollout's."""
    mask = mb["response_mask"]
    if cfg.bypass_mode:
        old = zero_masked(mb["rollout_log_probs"], mask)
    else:
        old = mb["old_log_probs"] if "old_log_probs" in mb else log_probs.detach()
    if IS_WEIGHTS in mb:  # decoupled: prepared before the update
        return old, mb[IS_WEIGHTS], mask, {}
    if not corr.active or (not cfg.bypass_mode and "old_log_probs" in mb):
        return old, None, mask, {}
    rollout = zero_masked(mb["rollout_log_probs"], mask)
    weights, kept, metrics = rollout_correction(log_probs.detach(), rollout, mask, corr)
    if cfg.bypass_mode and cfg.policy_loss_mode == "vanilla":
        weights = None  # PPO's ratio π_θ / π_rollout is the importance weight already (verl: no double count)
    return old, weights, kept, metrics
