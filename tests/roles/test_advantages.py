"""Advantage estimators and in-reward KL against small cases worked out by hand (verl's
core_algos conventions: sums of token rewards, unbiased group std, unbiased masked whitening)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hfrt.roles.losses import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)

T = torch.tensor

# 2 × 3: the second response ends after 2 tokens; its third value is garbage the scan must ignore
REWARDS = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
VALUES = T([[0.5, 0.25, 0.5], [1.0, 0.5, 9.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def close(got: torch.Tensor, want: list[list[float]] | list[float]) -> None:
    assert torch.allclose(got, T(want), atol=1e-5), f"{got} != {want}"


def test_gae_with_gamma_and_lambda_one() -> None:
    adv, ret = compute_gae_advantage_return(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    # raw advantages: reward-to-go minus value; the masked tail keeps lastgaelam = 0
    # row 0: [1 - .5, 1 - .25, 1 - .5] = [.5, .75, .5]; row 1: [2 - 1, 2 - .5, 0] = [1, 1.5, 0]
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 9.0]])  # raw advantages + values
    # whitening over the 5 response tokens: mean .85, unbiased var .7 / 4 = .175
    s = math.sqrt(0.175 + 1e-8)
    close(adv, [[-0.35 / s, -0.1 / s, -0.35 / s], [0.15 / s, 0.65 / s, -0.85 / s]])


def test_gae_with_gamma_09_lambda_095() -> None:
    _, ret = compute_gae_advantage_return(REWARDS, VALUES, MASK, gamma=0.9, lam=0.95)
    # row 0: t2 δ=.5 → .5; t1 δ=.9·.5−.25=.2 → .2+.855·.5=.6275; t0 δ=.9·.25−.5=−.275 → −.275+.855·.6275
    row0 = [-0.275 + 0.855 * 0.6275, 0.6275, 0.5]
    # row 1: t2 masked → 0; t1 δ=2−.5=1.5 → 1.5; t0 δ=.9·.5−1=−.55 → −.55+.855·1.5=.7325
    row1 = [0.7325, 1.5, 0.0]
    close(ret, [[a + v for a, v in zip(row0, [0.5, 0.25, 0.5], strict=True)], [1.7325, 2.0, 9.0]])
    raw = T([row0, row1])
    flat = raw[MASK.bool()]
    close(compute_gae_advantage_return(REWARDS, VALUES, MASK, 0.9, 0.95)[0],
          ((raw - flat.mean()) / torch.sqrt(flat.var() + 1e-8)).tolist())


def test_gae_carries_next_value_and_gae_through_a_masked_middle_token() -> None:
    rewards, values, mask = T([[0.0, 0.0, 1.0]]), T([[0.5, 7.0, 0.25]]), T([[1.0, 0.0, 1.0]])
    _, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    # t2: .75; t1 (masked): carries .75; t0: δ = 0 + .25 − .5 = −.25 → −.25 + .75 = .5
    close(ret, [[0.5 + 0.5, 0.75 + 7.0, 0.75 + 0.25]])


INDEX = ["a", "a", "a", "b", "c", "c"]
OUT_MASK = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
# scores (sum of token rewards): a = 1, 0, 2; b = 3; c = 1, 1
OUT_REWARDS = T([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.5, 0.5]])


def test_grpo_normalises_by_group_std_and_a_single_sample_group_by_one() -> None:
    adv, ret = compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK, INDEX)
    # a: mean 1, unbiased std 1; b: mean 0, std 1; c: mean 1, std 0 → 0 / 1e-6 = 0
    d = 1 + 1e-6
    want = [0.0, -1 / d, 1 / d, 3 / d, 0.0, 0.0]
    close(adv, (T(want)[:, None] * OUT_MASK).tolist())
    assert torch.equal(adv, ret)


def test_dr_grpo_only_subtracts_the_group_mean() -> None:
    adv, _ = compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK, INDEX, norm_adv_by_std=False)
    close(adv, (T([0.0, -1.0, 1.0, 3.0, 0.0, 0.0])[:, None] * OUT_MASK).tolist())


def test_rloo_leave_one_out_baseline() -> None:
    rewards = OUT_REWARDS.clone()
    rewards[5] = T([1.0, 2.0])  # c = 1, 3
    adv, _ = compute_rloo_outcome_advantage(rewards, OUT_MASK, INDEX)
    # a (n=3, mean 1): (s − 1)·3/2; b alone keeps 3; c (n=2, mean 2): (s − 2)·2
    close(adv, (T([0.0, -1.5, 1.5, 3.0, -2.0, 2.0])[:, None] * OUT_MASK).tolist())


def test_reinforce_plus_plus_discounted_return_whitened() -> None:
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(REWARDS, MASK, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # over [.25, .5, 1, 1, 2]: mean .95, unbiased var 1.8 / 4 = .45; masked positions 0
    s = math.sqrt(0.45 + 1e-8)
    close(adv, [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]])


def test_reinforce_plus_plus_return_resets_after_a_masked_token() -> None:
    _, ret = compute_reinforce_plus_plus_outcome_advantage(T([[1.0, 0.0, 4.0]]), T([[1.0, 0.0, 1.0]]), gamma=0.5)
    close(ret, [[1.0, 2.0, 4.0]])  # t1 sees 4·.5 = 2, then the running return is reset


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens() -> None:
    rewards = T([[0.0, 1.0], [1.0, 2.0], [0.0, 0.0], [0.0, 0.0]])  # scores 1, 3, 0, 0
    adv, ret = compute_reinforce_pp_baseline_advantage(rewards, torch.ones(4, 2), ["a", "a", "b", "b"])
    # centred [−1, 1, 0, 0] per token: mean 0, unbiased var 4 / 7
    s = math.sqrt(4 / 7 + 1e-8)
    close(adv, [[-1 / s, -1 / s], [1 / s, 1 / s], [0.0, 0.0], [0.0, 0.0]])
    assert torch.equal(adv, ret)


def test_remax_reward_to_go_minus_greedy_baseline() -> None:
    rewards = T([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    adv, ret = compute_remax_outcome_advantage(rewards, T([0.5, 2.0]), T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    close(ret, [[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    close(adv, [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])


def test_apply_kl_penalty_k1() -> None:
    old = T([[0.0, -1.0, -2.0], [-1.0, -1.0, -3.0]])
    ref = T([[-0.5, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    rewards, current = apply_kl_penalty(REWARDS, old, ref, MASK, beta=0.1, kind="kl")
    # KL = old − ref = [[.5, 0, −1], [0, −1, (masked)]]
    close(rewards, [[-0.05, 0.0, 1.1], [0.0, 2.1, 0.0]])
    assert current == pytest.approx(((-0.5 / 3) + (-1 / 2)) / 2)


def test_apply_kl_penalty_k2() -> None:
    rewards, current = apply_kl_penalty(T([[1.0, 1.0]]), T([[0.0, -2.0]]), T([[-1.0, -1.0]]), T([[1.0, 1.0]]), 0.5, "k2")
    close(rewards, [[0.75, 0.75]])  # ½·1² = .5 each, times β = .5
    assert current == pytest.approx(0.5)


def test_kl_controllers() -> None:
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=64)
    assert fixed.value == 0.05
    adaptive = AdaptiveKLController(0.2, target_kl=6.0, horizon=10000)
    adaptive.update(current_kl=9.0, n_steps=256)  # error .5 clipped to .2
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    adaptive.update(current_kl=5.7, n_steps=100)  # error −.05
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.05 * 100 / 10000))
    with pytest.raises(ValueError, match="target_kl > 0"):
        AdaptiveKLController(0.2, target_kl=0.0, horizon=10)


def test_compute_advantages_endpoint_in_process() -> None:
    from hfrt.daemon.batch import Batch
    from hfrt.roles.components.advantage import Advantages

    rollout = Batch({"response_mask": OUT_MASK, "token_level_scores": OUT_REWARDS}, {"uid": list(INDEX)})
    logp = Batch({"old_log_probs": torch.zeros(6, 2), "ref_log_prob": torch.full((6, 2), -0.5)})
    out = Advantages().compute(rollout, logp, estimator="grpo", norm_adv_by_std=False)
    close(out["advantages"], (T([0.0, -1.0, 1.0, 3.0, 0.0, 0.0])[:, None] * OUT_MASK).tolist())
    metrics = out.meta["metrics"]
    assert metrics["kl/mean"] == pytest.approx(0.5) and metrics["advantages/max"] == pytest.approx(3.0)

    host = Advantages()
    values = Batch({"values": torch.zeros(6, 2)})
    out = host.compute(rollout, logp, values, use_kl_in_reward=True, kl_coef=0.1, kl_ctrl="adaptive", target_kl=1.0, horizon=60)
    # in-reward KL (k1 = .5 per token) lowers every token's reward by .05; gae returns = reward-to-go
    assert out["token_level_rewards"][0].tolist() == pytest.approx([-0.05, 0.95])
    assert out["returns"][0].tolist() == pytest.approx([0.9, 0.95])
    assert out.meta["metrics"]["actor/reward_kl_penalty_coeff"] == 0.1
    assert host._kl_controller is not None and host._kl_controller.value == pytest.approx(0.1 * (1 - 0.2 * 6 / 60))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        host.compute(rollout, estimator="nope")
    with pytest.raises(ValueError, match="unknown field"):
        host.compute(rollout, estimator="grpo", gama=1.0)


def test_advantage_state_survives_a_checkpoint() -> None:
    """The in-reward KL controller's coefficient goes into state.json and comes back exactly."""
    from hfrt.daemon.batch import Batch
    from hfrt.roles.components.advantage import Advantages

    rollout = Batch({"response_mask": OUT_MASK, "token_level_scores": OUT_REWARDS}, {"uid": list(INDEX)})
    logp = Batch({"old_log_probs": torch.zeros(6, 2), "ref_log_prob": torch.full((6, 2), -0.5)})
    opts = {"estimator": "grpo", "use_kl_in_reward": True, "kl_coef": 0.1, "kl_ctrl": "adaptive", "target_kl": 1.0, "horizon": 60}
    first = Advantages()
    assert first.state() == {}
    first.compute(rollout, logp, **opts)
    saved = first.state()
    assert saved == {"kind": "adaptive", "value": pytest.approx(0.1 * (1 - 0.2 * 6 / 60))}
    resumed = Advantages()
    resumed.load_state(saved)
    a = first.compute(rollout, logp, **opts).meta["metrics"]["actor/reward_kl_penalty_coeff"]
    b = resumed.compute(rollout, logp, **opts).meta["metrics"]["actor/reward_kl_penalty_coeff"]
    assert a == b == saved["value"]  # not the initial 0.1: the resumed run goes on from the saved coefficient
    assert first.state() == resumed.state()


# -------------------------------------------------------------------- opo, grpo_passk, gpg, OTB


def test_opo_baseline_is_the_length_weighted_group_mean() -> None:
    from hfrt.roles.losses import compute_opo_outcome_advantage

    # a: scores 1 (2 tokens), 0 (1 token), 2 (2 tokens) → b = (2·1 + 1·0 + 2·2)/5 = 1.2; b alone: 0; c: (1·1 + 2·1)/3 = 1
    adv, ret = compute_opo_outcome_advantage(OUT_REWARDS, OUT_MASK, INDEX)
    close(adv, (T([-0.2, -1.2, 0.8, 3.0, 0.0, 0.0])[:, None] * OUT_MASK).tolist())
    assert torch.equal(adv, ret)


def test_grpo_passk_gives_only_the_best_sample_the_gap_to_the_second() -> None:
    from hfrt.roles.losses import compute_grpo_passk_outcome_advantage

    rewards = T([[0.0, 1.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.5], [1.0, 0.0]])  # a = 1, 0, 3; c = 0.5, 1
    index = ["a", "a", "a", "c", "c"]
    mask = torch.ones(5, 2)
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std=False)
    close(adv, (T([0.0, 0.0, 2.0, 0.0, 0.5])[:, None] * mask).tolist())
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index)  # ÷ (group std + ε)
    std_a, std_c = float(T([1.0, 0.0, 3.0]).std()), float(T([0.5, 1.0]).std())
    close(adv[:, 0], [0.0, 0.0, 2.0 / (std_a + 1e-6), 0.0, 0.5 / (std_c + 1e-6)])
    with pytest.raises(ValueError, match="at least 2 samples per group; group 'b' has 1"):
        compute_grpo_passk_outcome_advantage(OUT_REWARDS, OUT_MASK, INDEX)


def test_gpg_scales_the_centred_score_by_the_share_of_nonzero_rows() -> None:
    from hfrt.roles.losses import compute_gpg_outcome_advantage

    # scores a = 1, 0, 2; b = 3; c = 1, 1 → 5 of 6 non-zero: α = 6/5; b alone has mean 0
    adv, _ = compute_gpg_outcome_advantage(OUT_REWARDS, OUT_MASK, INDEX, f_norm=2.0)
    close(adv, (T([0.0, -1.0, 1.0, 3.0, 0.0, 0.0])[:, None] * 0.6 * OUT_MASK).tolist())


def _otb_case() -> dict[str, torch.Tensor]:
    """One group of two: row 0 has 2 tokens and reward 1 at its end, row 1 has 1 token and reward 0;
    π = 0.5 everywhere and Σπ² = 0.5, so each w = 1 − 2·0.5 + 0.5 = 0.5."""
    return {"rewards": T([[0.0, 1.0], [0.0, 0.0]]), "mask": T([[1.0, 1.0], [1.0, 0.0]]),
            "old": torch.full((2, 2), math.log(0.5)), "spp": torch.full((2, 2), 0.5)}


def test_optimal_token_baseline_by_hand() -> None:
    from hfrt.roles.losses import compute_optimal_token_baseline_advantage

    c = _otb_case()
    adv, ret = compute_optimal_token_baseline_advantage(c["rewards"], c["mask"], ["p", "p"], c["old"], c["spp"])
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    # W (cumulative w): row 0 [.5, 1], row 1 [.5, .5→masked]. t0: B = (1·.5 + 0·.5)/(.5 + .5) = .5;
    # t1: only row 0 counts: B = 1·1/1 = 1
    close(adv, [[0.5, 0.0], [-0.5, 0.0]])
    weights = T([[2.0, 1.0], [1.0, 1.0]])  # ρ̄² scales w: row 0's t0 weight 4·.5 = 2
    adv, _ = compute_optimal_token_baseline_advantage(c["rewards"], c["mask"], ["p", "p"], c["old"], c["spp"], weights)
    close(adv[:, 0], [1 - 2 / 2.5, -2 / 2.5])  # B_0 = (1·2 + 0·.5)/2.5
    adv, _ = compute_optimal_token_baseline_advantage(c["rewards"], c["mask"], ["p", "p"], c["old"], c["spp"], handle_zero_tail=True)
    close(adv, [[0.5, 1.0], [-0.5, 0.0]])  # past the second-longest length the longest gets baseline 0


def test_tir_token_baseline_aligns_response_tokens_across_holes() -> None:
    from hfrt.roles.losses import compute_tir_optimal_token_baseline_advantage

    # row 0's response tokens sit at positions 0 and 2 (position 1 is a tool's output, masked)
    rewards, mask = T([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), T([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    old, spp = torch.full((2, 3), math.log(0.5)), torch.full((2, 3), 0.5)
    adv, ret = compute_tir_optimal_token_baseline_advantage(rewards, mask, ["p", "p"], old, spp, handle_zero_tail=False)
    close(ret, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(adv, [[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]])  # packed step 1 is row 0's alone: baseline = its return
    adv, _ = compute_tir_optimal_token_baseline_advantage(rewards, mask, ["p", "p"], old, spp)  # zero tail: verl's default
    close(adv, [[0.5, 0.0, 1.0], [-0.5, 0.0, 0.0]])


def test_new_estimators_through_the_endpoint() -> None:
    from hfrt.daemon.batch import Batch
    from hfrt.roles.components.advantage import AdvantageParams, Advantages
    from hfrt.wire.loss_options import ADVANTAGE_OPTIONS

    assert set(ADVANTAGE_OPTIONS) == {f.name for f in dataclasses.fields(AdvantageParams)}  # the wire's list is the daemon's
    rollout = Batch({"response_mask": OUT_MASK, "token_level_scores": OUT_REWARDS}, {"uid": list(INDEX)})
    out = Advantages().compute(rollout, estimator="opo")
    close(out["advantages"], (T([-0.2, -1.2, 0.8, 3.0, 0.0, 0.0])[:, None] * OUT_MASK).tolist())
    out = Advantages().compute(rollout, estimator="gpg", f_norm=2.0)
    close(out["advantages"][:, 0], [0.0, -0.6, 0.6, 1.8, 0.0, 0.0])
    c = _otb_case()
    otb = Batch({"response_mask": c["mask"], "token_level_scores": c["rewards"]}, {"uid": ["p", "p"]})
    with pytest.raises(KeyError, match="sum_pi_squared=True"):
        Advantages().compute(otb, Batch({"old_log_probs": c["old"]}), estimator="optimal_token_baseline")
    out = Advantages().compute(otb, Batch({"old_log_probs": c["old"], "sum_pi_squared": c["spp"]}), estimator="optimal_token_baseline")
    close(out["advantages"], [[0.5, 0.0], [-0.5, 0.0]])
    out = Advantages().compute(otb, Batch({"old_log_probs": c["old"], "sum_pi_squared": c["spp"]}),
                               estimator="tir_optimal_token_baseline", handle_zero_tail=False)
    close(out["advantages"], [[0.5, 0.0], [-0.5, 0.0]])


def test_token_baseline_weights_from_rollout_is() -> None:
    """rollout_is makes compute_advantages scale OTB's w by ρ̄² itself (old vs rollout log-probs)."""
    from hfrt.daemon.batch import Batch
    from hfrt.roles.components.advantage import Advantages
    from hfrt.roles.losses import compute_optimal_token_baseline_advantage

    c = _otb_case()
    rollout = c["old"] - T([[LN4, 0.0], [0.0, 0.0]])  # ρ = 4 on row 0's first token → truncated at 2
    otb = Batch({"response_mask": c["mask"], "token_level_scores": c["rewards"]}, {"uid": ["p", "p"]})
    cols = Batch({"old_log_probs": c["old"], "sum_pi_squared": c["spp"], "rollout_log_probs": rollout})
    out = Advantages().compute(otb, cols, estimator="optimal_token_baseline", rollout_is="token", rollout_is_threshold=2.0)
    want, _ = compute_optimal_token_baseline_advantage(c["rewards"], c["mask"], ["p", "p"], c["old"], c["spp"],
                                                       T([[2.0, 1.0], [1.0, 0.0]]))
    close(out["advantages"], want.tolist())
    close(out["advantages"][:, 0], [1 - 2 / 2.5, -2 / 2.5])


LN4 = math.log(4.0)
