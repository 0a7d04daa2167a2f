"""Rollout correction as verl's rollout_corr_helper defines it, on cases worked out by hand:
token and sequence importance weights (truncated, batch-normalised), rejection by each divergence
statistic (token / sequence sum / mean / max of k1, k2, k3; IcePop's token masking), the
off-policy metrics; and the actor's objective using them — decoupled (prepared once before the
update) and bypass mode (old := rollout log-probs; PPO-clip without weights, REINFORCE with)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hfrt.roles.losses import PolicyLossConfig, RolloutCorrection, agg_loss, policy_loss, rollout_correction
from hfrt.roles.losses.corrections import is_weights, offpolicy_metrics, rejection_mask
from hfrt.roles.training.actor_loss import IS_WEIGHTS, actor_loss, prepare_corrections, update_columns
from hfrt.roles.training.engines import ForwardOutput
from hfrt.wire.loss_options import ActorLoss, UpdateSchedule, rs_thresholds

T = torch.tensor
LN2 = math.log(2.0)
# two rows: [log 2, 0, −log 2] and [log 3, log 3, pad]
LOG_RATIO = T([[LN2, 0.0, -LN2], [math.log(3.0), math.log(3.0), 0.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_weights_truncate_and_report_before_truncation() -> None:
    w, m = is_weights(LOG_RATIO, MASK, "token", threshold=2.5)
    assert torch.allclose(w, T([[2.0, 1.0, 0.5], [2.5, 2.5, 0.0]]), atol=1e-6)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # the two 3s, before truncation
    assert m["rollout_is_ratio_fraction_low"] == 0.0  # 0.5 is not below 1/2.5
    assert m["rollout_is_max"] == pytest.approx(3.0) and m["rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_is_mean"] == pytest.approx((2 + 1 + 0.5 + 3 + 3) / 5)


def test_sequence_weights_are_the_product_over_the_sequence() -> None:
    w, m = is_weights(LOG_RATIO, MASK, "sequence", threshold=5.0)
    # row 0: 2·1·0.5 = 1; row 1: 3·3 = 9 → truncated to 5; padding 0
    assert torch.allclose(w, T([[1.0, 1.0, 1.0], [5.0, 5.0, 0.0]]), atol=1e-5)
    assert m["rollout_is_max"] == pytest.approx(9.0, rel=1e-5) and m["rollout_is_ratio_fraction_high"] == 0.5


def test_batch_normalisation_divides_by_the_mean_weight() -> None:
    w, m = is_weights(LOG_RATIO, MASK, "token", threshold=2.5, batch_normalize=True)
    mean = (2 + 1 + 0.5 + 2.5 + 2.5) / 5
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert float((w * MASK).sum() / MASK.sum()) == pytest.approx(1.0)
    w, m = is_weights(LOG_RATIO, MASK, "sequence", threshold=5.0, batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(3.0)  # mean over sequences of (1, 5)
    # a cross-rank mean: `reduce` sums [total, count] over ranks (here: a second rank like this one)
    w2, m2 = is_weights(LOG_RATIO, MASK, "sequence", threshold=5.0, batch_normalize=True,
                        reduce=lambda v: [2 * float(x) for x in v])
    assert torch.allclose(w2, w) and m2["rollout_is_batch_norm_factor"] == pytest.approx(3.0)


def test_token_k1_is_icepop_style_masking() -> None:
    """token_k1 keeps log(lower) ≤ −log r ≤ log(upper): with "0.5_2" a token leaves the batch
    when π_train / π_rollout is outside [0.5, 2]: the 3s are masked, 2 and 0.5 stay."""
    kept, m = rejection_mask(LOG_RATIO, MASK, "token_k1", "0.5_2")
    assert torch.equal(kept, T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_rs_token_k1_fraction_low"] == pytest.approx(2 / 5)  # −log 3 < log 0.5
    # verl's convention: the bounds are on π_rollout / π_train; asymmetric bounds read inverted
    kept, _ = rejection_mask(LOG_RATIO, MASK, "token_k1", "0.25_1.5")  # keeps r in [1/1.5, 4]
    assert torch.equal(kept, T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))


def test_sequence_statistics_reject_whole_sequences() -> None:
    k2 = 0.5 * LOG_RATIO**2  # row 0: [.24, 0, .24], row 1: [.60, .60]
    kept, m = rejection_mask(LOG_RATIO, MASK, "seq_sum_k2", 1.0)  # sums .48 and 1.21
    assert torch.equal(kept, T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert m["rollout_rs_seq_sum_k2_max"] == pytest.approx(float(k2[1, :2].sum()), abs=1e-6)
    kept, _ = rejection_mask(LOG_RATIO, MASK, "seq_mean_k2", 0.2)  # means .16 and .60
    assert torch.equal(kept, T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    kept, _ = rejection_mask(LOG_RATIO, MASK, "seq_max_k3", 0.3)  # k3 = r − 1 − log r: row 0 max .31
    assert torch.equal(kept, torch.zeros(2, 3))
    kept, _ = rejection_mask(LOG_RATIO, MASK, "seq_sum_k1", 1.5)  # −Σ log r: 0 and −2.2 < log(1/1.5)
    assert torch.equal(kept, T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    both, m = rejection_mask(LOG_RATIO, MASK, "token_k2,seq_mean_k3", "0.2,1")  # every option must pass
    assert torch.equal(both, T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert {"rollout_rs_token_k2_masked_fraction", "rollout_rs_seq_mean_k3_masked_fraction"} <= set(m)


def test_threshold_parsing_follows_verl() -> None:
    assert rs_thresholds("token_k1", 2) == [("token_k1", 0.5, 2.0)]
    assert rs_thresholds("token_k1,seq_sum_k3", "0.5_2,0.1") == [("token_k1", 0.5, 2.0), ("seq_sum_k3", None, 0.1)]
    for bad, spec, message in (("token_k4", 1, "use one or more"), ("token_k1", None, "needs rollout_rs_threshold"),
                               ("token_k2", "0.1_2", "not a threshold"), ("token_k1,token_k2", "1,2,3", "one per"),
                               ("token_k2", -1, "positive")):
        with pytest.raises(ValueError, match=message):
            rs_thresholds(bad, spec)


def test_offpolicy_metrics_by_hand() -> None:
    train = T([[-1.0, -2.0]])
    rollout = T([[-1.0, -1.0]])
    m = offpolicy_metrics(train, rollout, torch.ones(1, 2))
    assert m["kl"] == pytest.approx(0.5)  # mean(rollout − train)
    assert m["k3_kl"] == pytest.approx((math.exp(-1) + 1 - 1) / 2)
    assert m["training_ppl"] == pytest.approx(math.exp(1.5)) and m["rollout_ppl"] == pytest.approx(math.e)
    assert m["chi2_token"] == pytest.approx((1 + math.exp(-2)) / 2 - 1)
    assert m["chi2_seq"] == pytest.approx(math.exp(-2) - 1)
    weights, kept, out = rollout_correction(train, rollout, torch.ones(1, 2), RolloutCorrection("token", 2.0, False, "token_k1", 2))
    assert weights is not None and torch.allclose(weights, T([[1.0, math.exp(-1)]]))
    assert torch.equal(kept, T([[1.0, 0.0]])) and out["rollout_corr/kl"] == pytest.approx(0.5)


# -------------------------------------------------------------------- through the actor's objective


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rollout = -torch.rand(2, 3, generator=g) - 0.5
    old = rollout + T([[0.0, 0.9, -0.1], [0.2, 0.0, 0.0]])  # token (0, 1): π_old / π_rollout = e^0.9 ≈ 2.5
    return {"response_mask": mask, "rollout_log_probs": rollout, "old_log_probs": old,
            "advantages": T([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]),
            "log_probs": old + T([[0.05, -0.05, 0.1], [0.0, 0.02, 0.0]])}


def _loss(cfg: ActorLoss, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    from hfrt.roles.losses import LossScale

    mask = mb["response_mask"]
    scale = LossScale(float(mask.sum()), float((mask.sum(-1) > 0).sum()), 1)
    fn = actor_loss(cfg)(scale, {})
    return fn(ForwardOutput(log_probs=mb["log_probs"]), mb, scale)


def test_decoupled_correction_is_prepared_once_and_weights_the_policy_loss() -> None:
    cfg = ActorLoss(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold=3.0)
    b = _batch()
    tensors = {k: v.clone() for k, v in b.items() if k != "log_probs"}
    metrics = prepare_corrections(tensors, cfg)
    ratio = torch.exp(b["old_log_probs"] - b["rollout_log_probs"])
    assert torch.allclose(tensors[IS_WEIGHTS], ratio.clamp(max=2.0) * b["response_mask"])
    assert torch.equal(tensors["response_mask"], b["response_mask"])  # e^0.9 < 3: nothing rejected
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    loss, _ = _loss(cfg, tensors | {"log_probs": b["log_probs"]})
    plain = PolicyLossConfig()
    want, _ = policy_loss(b["log_probs"], b["old_log_probs"], b["advantages"], b["response_mask"], plain,
                          weights=ratio.clamp(max=2.0))
    assert torch.allclose(loss, want)
    strict = ActorLoss(rollout_rs="token_k1", rollout_rs_threshold=2.0)  # now e^0.9 > 2: that token leaves the mask
    tensors = {k: v.clone() for k, v in b.items() if k != "log_probs"}
    assert prepare_corrections(tensors, strict)["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert tensors["response_mask"][0].tolist() == [1.0, 0.0, 1.0] and IS_WEIGHTS not in tensors


def test_bypass_mode_uses_the_rollout_as_old_and_weights_only_reinforce() -> None:
    b = _batch()
    mb = {k: v for k, v in b.items() if k not in ("old_log_probs", "log_probs")}
    ppo = ActorLoss(bypass_mode=True, rollout_is="token", rollout_is_threshold=2.0)
    loss, metrics = _loss(ppo, mb | {"log_probs": b["log_probs"]})
    want, _ = policy_loss(b["log_probs"], b["rollout_log_probs"], b["advantages"], b["response_mask"], PolicyLossConfig())
    assert torch.allclose(loss, want)  # PPO's ratio is π_θ / π_rollout: no weight on top (verl)
    assert "rollout_corr/rollout_is_mean" in metrics  # the weights are still measured
    pg = ActorLoss(bypass_mode=True, policy_loss_mode="reinforce", rollout_is="token", rollout_is_threshold=2.0)
    loss, metrics = _loss(pg, mb | {"log_probs": b["log_probs"]})
    w = torch.exp(b["log_probs"] - b["rollout_log_probs"]).clamp(max=2.0)
    want = agg_loss(-b["advantages"] * b["log_probs"] * w, b["response_mask"], "token-mean")
    assert torch.allclose(loss, want, atol=1e-6)
    kl = float(((b["rollout_log_probs"] - b["log_probs"]) * b["response_mask"]).sum() / 5)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(kl, abs=1e-6)


def test_update_columns_follow_the_options() -> None:
    schedule = UpdateSchedule()
    assert update_columns(ActorLoss(), {"old_log_probs"}, schedule, 4, "t") == ["advantages", "old_log_probs"]
    assert update_columns(ActorLoss(bypass_mode=True), {"old_log_probs"}, UpdateSchedule(ppo_epochs=2), 4, "t") == [
        "advantages", "rollout_log_probs"]  # the rollout's are the old ones: several steps are fine
    assert "rollout_log_probs" in update_columns(ActorLoss(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1), set(), schedule, 4, "t")
    with pytest.raises(ValueError, match="no old_log_probs column"):
        update_columns(ActorLoss(), set(), UpdateSchedule(ppo_epochs=2), 4, "t")


def test_prepared_correction_refuses_a_batch_without_response_tokens() -> None:
    b = _batch()
    tensors = {k: v.clone() for k, v in b.items() if k != "log_probs"} | {"response_mask": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="needs at least one response token on every data-parallel rank"):
        prepare_corrections(tensors, ActorLoss(rollout_is="token"))
    assert prepare_corrections(tensors, ActorLoss()) == {}  # nothing asked for: nothing computed
