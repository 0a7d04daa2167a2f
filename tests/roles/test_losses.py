"""Loss math against verl's core_algos conventions and hand-computed values: aggregation over rows
that have tokens, Dr.GRPO's sum-norm, whitening's minimum, padding that holds NaN, and the policy
loss modes (GSPO's, CISPO's and decoupled PPO's gradients, truncated importance sampling)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hfrt.roles.losses import (
    AGG_MODES,
    LossScale,
    PolicyLossConfig,
    agg_loss,
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from hfrt.roles.training.updates import UpdateSchedule, counts, run_updates
from hfrt.wire.loss_options import POLICY_LOSS_MODES

T = torch.tensor
NAN, INF = float("nan"), float("inf")


def _with_empty_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """6 × 4 losses; rows 1 and 4 have no response token."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(6, 4, generator=g)
    lengths = T([4, 0, 2, 3, 0, 1])
    return loss, (torch.arange(4)[None, :] < lengths[:, None]).float()


# -------------------------------------------------------------------- aggregation (verl's agg_loss)


def test_seq_mean_modes_average_only_over_rows_with_a_token() -> None:
    loss, mask = _with_empty_rows()
    valid = mask.sum(-1) > 0
    sums = (loss * mask).sum(-1)[valid]
    means = sums / mask.sum(-1)[valid]
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum"), sums.sum() / 4)
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-mean"), means.sum() / 4)
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm-mean"), sums.sum() / (4 * 4))
    # token-mean never counted rows; sum-norm divides by the horizon only (verl's Dr.GRPO)
    assert torch.allclose(agg_loss(loss, mask, "token-mean"), sums.sum() / mask.sum())
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm"), sums.sum() / 4)
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_horizon=10), sums.sum() / 10)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_shares_with_empty_rows_add_up_to_the_whole_batch_loss(mode: str) -> None:
    loss, mask = _with_empty_rows(1)
    whole = agg_loss(loss, mask, mode)
    dp = 2
    tokens, seqs = counts(mask)  # what run_updates all-reduces over ranks
    assert (tokens, seqs) == (float(mask.sum()), 4.0)
    scale = LossScale(tokens, seqs, dp)
    per_rank = []
    for rows in (slice(0, 3), slice(3, 6)):  # two ranks, micro-batches of 2 rows then 1
        r_loss, r_mask = loss[rows], mask[rows]
        per_rank.append(sum(agg_loss(r_loss[i : i + 2], r_mask[i : i + 2], mode, scale) for i in (0, 2)))
    assert torch.allclose(torch.stack(per_rank).sum() / dp, whole, atol=1e-6)  # gradients are averaged


def test_token_mean_of_a_batch_without_tokens_is_zero() -> None:
    loss = T([[NAN, 1.0], [2.0, INF]])
    empty = torch.zeros(2, 2)
    for mode in AGG_MODES:
        assert agg_loss(loss, empty, mode).item() == 0.0, mode
    # with a LossScale, a micro-batch of padding rows contributes nothing either
    assert agg_loss(loss, empty, "token-mean", LossScale(5.0, 2.0, 2)).item() == 0.0


class _RecordingEngine:
    """Stands in for a TrainEngine (pure logic: no model); make_loss records each step's LossScale."""

    dp_size = 1
    dp_group = None

    def __init__(self) -> None:
        self.scales: list[LossScale] = []
        self.sharing = SimpleNamespace(tokens=[0, 0])  # shared-prefix counts: none shared here

    def from_last_stage(self, value: Any) -> Any:
        return value

    def step(self, loss_fn: Any, mini: dict[str, torch.Tensor], micro: Any, **_: Any) -> dict[str, float]:
        return {"lr": 0.0, "loss": 0.0}


def test_run_updates_counts_only_rows_with_a_response_token() -> None:
    engine = _RecordingEngine()
    mask = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # row 1: an empty response
    tensors = {"response_mask": mask, "responses": torch.zeros(3, 3, dtype=torch.long)}

    def make_loss(scale: LossScale, shares: dict[str, float]) -> Any:
        engine.scales.append(scale)
        return lambda out, mb, _: (torch.zeros(()), {})

    run_updates(engine, tensors, make_loss, UpdateSchedule(), prefix="actor", endpoint="test")  # type: ignore[arg-type]
    assert [(s.global_tokens, s.global_seqs) for s in engine.scales] == [(3.0, 2.0)]


# -------------------------------------------------------------------- whitening and padding


def test_whitening_needs_two_valid_tokens() -> None:
    values = T([[1.0, 5.0, 7.0]])
    for mask in (T([[0.0, 0.0, 0.0]]), T([[0.0, 1.0, 0.0]])):
        with pytest.raises(ValueError, match="at least 2 response tokens"):
            masked_whiten(values, mask)
    two = masked_whiten(values, T([[1.0, 1.0, 0.0]]))
    assert torch.allclose(two[0, :2], T([-2.0, 2.0]) / 8**0.5, atol=1e-6)  # mean 3, unbiased var 8
    one_token = T([[1.0, 0.0]])
    with pytest.raises(ValueError, match="at least 2"):
        compute_gae_advantage_return(T([[1.0, 0.0]]), T([[0.5, 0.0]]), one_token)
    with pytest.raises(ValueError, match="at least 2"):
        compute_reinforce_plus_plus_outcome_advantage(T([[1.0, 0.0]]), one_token)


def _padded_batch() -> dict[str, torch.Tensor]:
    """Two rows; row 0 ends after 2 tokens and row 1 after 3, every padding input is NaN or inf."""
    mask = T([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    return {
        "mask": mask,
        "log_prob": T([[-0.5, -1.0, -2.0, -0.1], [-0.2, -0.3, -0.9, -3.0]]),
        "old": T([[-0.6, -0.9, NAN, INF], [-0.3, -0.2, -1.0, NAN]]),
        "adv": T([[1.0, 1.0, NAN, -INF], [-0.5, -0.5, -0.5, NAN]]),
        "rollout": T([[-0.7, -0.9, -INF, NAN], [-0.1, -0.2, -1.2, INF]]),
    }


def _clean(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.where(b["mask"].bool(), v, 0.0) if k != "mask" else v for k, v in b.items()}


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_nan_on_padding_reaches_neither_loss_nor_gradient(mode: str, agg: str) -> None:
    dirty, clean = _padded_batch(), _clean(_padded_batch())
    config = PolicyLossConfig(agg_mode=agg, mode=mode, tis_cap=2.0, clip_cov_lb=-10.0, clip_cov_ratio=0.3)
    results = []
    for b in (dirty, clean):
        log_prob = b["log_prob"].clone().requires_grad_(True)
        weights = torch.where(b["mask"].bool(), 1.5, NAN)  # rollout-correction weights, NaN on padding too
        loss, metrics = policy_loss(log_prob, b["old"], b["adv"], b["mask"], config, rollout_log_probs=b["rollout"],
                                    weights=weights, generator=torch.Generator().manual_seed(0))
        loss.backward()
        assert log_prob.grad is not None
        results.append((loss.detach(), log_prob.grad, metrics))
    (loss, grad, metrics), (want_loss, want_grad, want_metrics) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.allclose(loss, want_loss) and torch.allclose(grad, want_grad)
    assert (grad[~dirty["mask"].bool()] == 0).all()
    for key, value in metrics.items():
        assert torch.isfinite(value) and torch.allclose(value, want_metrics[key]), key


def test_value_loss_and_metrics_ignore_nan_padding() -> None:
    mask = T([[1.0, 0.0]])
    values = T([[0.5, 0.0]], requires_grad=True)
    loss, metrics = value_loss(values, T([[1.0, NAN]]), T([[0.4, INF]]), mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 0.25)
    assert values.grad is not None and torch.isfinite(values.grad).all()
    assert torch.isfinite(metrics["critic/vf_clipfrac"])
    assert masked_mean(T([[2.0, NAN]]), mask).item() == 2.0


# -------------------------------------------------------------------- policy loss modes


def _gspo_case() -> dict[str, torch.Tensor]:
    """Three sequences, the middle one shorter; small log-ratios so nothing is clipped."""
    return {
        "mask": T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        "log_prob": T([[-0.50, -1.00, -0.20], [-0.30, -0.70, 0.0], [-1.20, -0.40, -0.90]]),
        "old": T([[-0.52, -0.97, -0.21], [-0.28, -0.71, 0.0], [-1.18, -0.43, -0.88]]),
        "adv": T([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0], [2.0, 2.0, 2.0]]),
    }


def test_gspo_value_and_gradient_are_the_sequence_level_objective() -> None:
    b = _gspo_case()
    mask, adv_seq = b["mask"], b["adv"][:, 0]
    config = PolicyLossConfig(agg_mode="seq-mean-token-mean", mode="gspo")
    log_prob = b["log_prob"].clone().requires_grad_(True)
    loss, metrics = policy_loss(log_prob, b["old"], b["adv"], mask, config)
    loss.backward()
    # the paper's objective, written independently: s_i = exp(mean_t(logp − old)), L = −mean_i A_i s_i
    ref_lp = b["log_prob"].clone().requires_grad_(True)
    s = torch.exp(((ref_lp - b["old"]) * mask).sum(-1) / mask.sum(-1))
    want = -(adv_seq * s).mean()
    want.backward()
    assert torch.allclose(loss, want, atol=1e-6)
    assert ref_lp.grad is not None and log_prob.grad is not None
    assert torch.allclose(log_prob.grad, ref_lp.grad, atol=1e-6)
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert metrics["actor/ppo_kl"].item() == pytest.approx(float(((b["old"] - b["log_prob"]) * mask).sum() / mask.sum()))


def test_gspo_clips_a_whole_sequence() -> None:
    mask = torch.ones(2, 2)
    old = torch.zeros(2, 2)
    new = T([[0.5, 0.5], [0.05, -0.05]])  # s_0 = e^0.5 ≈ 1.65 > 1.2; s_1 = 1
    adv = T([[1.0, 1.0], [1.0, 1.0]])
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = policy_loss(log_prob, old, adv, mask, PolicyLossConfig(mode="gspo"))
    loss.backward()
    assert log_prob.grad is not None
    assert (log_prob.grad[0] == 0).all()  # the clipped sequence gets no gradient
    assert torch.allclose(log_prob.grad[1], T([-0.25, -0.25]))  # token-mean of −A·s with s = 1
    assert loss.item() == pytest.approx(-(1.2 * 2 + 1.0 * 2) / 4)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)


def test_cispo_gradient_is_clipped_weight_times_advantage_times_grad_logp() -> None:
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    old = torch.zeros(1, 4)
    new = T([[0.5, -0.5, 0.1, 0.0]])  # ratios e^.5 ≈ 1.65 (→ 1.28), e^-.5 ≈ .61 (→ .8), 1.105
    adv = T([[1.0, -2.0, 0.5, 0.0]])
    log_prob = new.clone().requires_grad_(True)
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, mode="cispo")
    loss, metrics = policy_loss(log_prob, old, adv, mask, config)
    loss.backward()
    weight = T([1.28, 0.8, float(torch.exp(T(0.1)))])
    want_grad = torch.cat([-weight * adv[0, :3] / 3, T([0.0])])
    assert log_prob.grad is not None
    assert torch.allclose(log_prob.grad[0], want_grad, atol=1e-6)
    assert loss.item() == pytest.approx(float(-(weight * adv[0, :3] * new[0, :3]).sum() / 3), abs=1e-6)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(2 / 3)


def test_truncated_importance_sampling_weights_each_token() -> None:
    mask = T([[1.0, 1.0, 1.0]])
    old = T([[-1.0, -1.0, -1.0]])
    rollout = T([[-1.0, -2.0, -1.5]])  # weights exp(0)=1, exp(1)=2.72 → cap 2, exp(.5)=1.65
    log_prob = old.clone()
    adv = T([[1.0, 1.0, -1.0]])
    plain, _ = policy_loss(log_prob, old, adv, mask, PolicyLossConfig())
    loss, metrics = policy_loss(log_prob, old, adv, mask, PolicyLossConfig(tis_cap=2.0), rollout_log_probs=rollout)
    w = T([1.0, 2.0, float(torch.exp(T(0.5)))])
    assert plain.item() == pytest.approx(-1 / 3)  # ratio 1: −A per token
    assert loss.item() == pytest.approx(float((-adv[0] * w).mean()), abs=1e-6)
    assert metrics["actor/tis_weight_mean"].item() == pytest.approx(float(w.mean()), abs=1e-6)
    assert metrics["actor/tis_truncated_frac"].item() == pytest.approx(1 / 3)
    for mode in ("gspo", "cispo"):
        _, m = policy_loss(log_prob, old, adv, mask, PolicyLossConfig(mode=mode, tis_cap=2.0), rollout_log_probs=rollout)
        assert m["actor/tis_truncated_frac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(log_prob, old, adv, mask, PolicyLossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="policy_loss_mode"):
        policy_loss(log_prob, old, adv, mask, PolicyLossConfig(mode="ppo2"))


def test_decoupled_ppo_value_and_gradient_are_its_objective() -> None:
    """Decoupled PPO: L = −mean_t w_t · min(r_t A_t, clip(r_t) A_t) with r = π/π_prox and the
    detached behaviour weight w = min(π_prox/π_behav, cap), written here independently (no dual
    clip is reached: the negative advantages' ratios stay below 3)."""
    mask = T([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    prox = T([[-1.0, -0.5, -2.0, -1.2], [-0.3, -0.9, -1.1, 0.0]])
    new = prox + T([[0.3, -0.05, 0.1, -0.4], [0.02, 0.5, -0.3, 0.0]])  # ratios 1.35 (clipped), .95, 1.1, .67 (clipped for A<0)...
    behaviour = prox + T([[0.2, -1.5, 0.0, 0.4], [-0.1, 0.3, 2.0, 0.0]])  # weights e^-.2, e^1.5 → cap 2, 1, e^-.4, ...
    adv = T([[1.0, 1.0, -0.5, -2.0], [0.7, -1.0, 1.5, 0.0]])
    cap, low, high = 2.0, 0.2, 0.28
    config = PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, mode="decoupled", tis_cap=cap)
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = policy_loss(log_prob, prox, adv, mask, config, rollout_log_probs=behaviour)
    loss.backward()

    ref_lp = new.clone().requires_grad_(True)
    ratio = torch.exp(ref_lp - prox)
    weight = torch.exp(prox - behaviour).clamp(max=cap)
    objective = weight * torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    want = -(objective * mask).sum() / mask.sum()
    want.backward()
    assert ref_lp.grad is not None and log_prob.grad is not None
    assert torch.allclose(loss, want, atol=1e-6)
    assert torch.allclose(log_prob.grad, ref_lp.grad, atol=1e-6)
    # where the clip holds the term the gradient is 0; elsewhere −w·A·r / tokens
    r = torch.exp(new - prox)
    clipped = ((r > 1 + high) & (adv > 0)) | ((r < 1 - low) & (adv < 0))
    assert clipped.sum() == 2 and (log_prob.grad[clipped] == 0).all()
    free = mask.bool() & ~clipped
    assert torch.allclose(log_prob.grad[free], (-weight * adv * r / mask.sum())[free], atol=1e-6)
    assert metrics["actor/tis_truncated_frac"].item() == pytest.approx(1 / 7)
    assert metrics["actor/behav_kl"].item() == pytest.approx(float(((behaviour - prox) * mask).sum() / 7), abs=1e-6)
    # the same numbers as vanilla with tis_cap: the mode names the objective and requires its inputs
    plain, _ = policy_loss(new, prox, adv, mask, PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, tis_cap=cap),
                           rollout_log_probs=behaviour)
    assert torch.allclose(plain, loss.detach())
    with pytest.raises(ValueError, match="decoupled needs the behaviour policy's log-probs .* rollout_log_probs missing"):
        policy_loss(new, prox, adv, mask, config)
    with pytest.raises(ValueError, match=r"decoupled needs .* tis_cap=None"):
        policy_loss(new, prox, adv, mask, PolicyLossConfig(mode="decoupled"), rollout_log_probs=behaviour)
