"""PPO-family loss math: aggregation modes, global loss scaling across micro-batches and ranks, clipping."""

from __future__ import annotations

import pytest
import torch

from hfrt.roles.losses import (
    AGG_MODES,
    LossScale,
    PolicyLossConfig,
    agg_loss,
    kl_penalty,
    masked_whiten,
    policy_loss,
    value_loss,
)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(6, 5, generator=g)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    return loss, mask


def test_agg_modes_match_their_definitions() -> None:
    loss, mask = _data()
    per_seq_sum = (loss * mask).sum(-1)
    assert torch.allclose(agg_loss(loss, mask, "token-mean"), (loss * mask).sum() / mask.sum())
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum"), per_seq_sum.mean())
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-mean"), (per_seq_sum / mask.sum(-1)).mean())
    # verl's Dr.GRPO mode: the token sum over a constant horizon, no division by the row count
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm"), per_seq_sum.sum() / 5)
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_horizon=8), per_seq_sum.sum() / 8)
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm-mean"), per_seq_sum.mean() / 5)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        agg_loss(loss, mask, "mean-of-everything")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_shares_over_micro_batches_and_ranks_sum_to_the_global_loss(mode: str) -> None:
    loss, mask = _data(1)
    whole = agg_loss(loss, mask, mode)
    dp = 2
    scale = LossScale(global_tokens=float(mask.sum()), global_seqs=6.0, dp_size=dp)
    ranks = [(loss[:3], mask[:3]), (loss[3:], mask[3:])]
    per_rank: list[torch.Tensor] = []
    for rank_loss, rank_mask in ranks:  # micro-batches of 2 rows, then 1 row
        shares = [agg_loss(rank_loss[i : i + 2], rank_mask[i : i + 2], mode, scale) for i in (0, 2)]
        per_rank.append(torch.stack(shares).sum())
    assert torch.allclose(torch.stack(per_rank).sum() / dp, whole, atol=1e-6)  # ranks' gradients are averaged


def test_policy_loss_clips_and_dual_clips() -> None:
    mask = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    # ratios e^0.5 ≈ 1.65 and e^-0.5 ≈ 0.61, with positive and negative advantages
    new = torch.tensor([[0.5, -0.5, 0.5, 2.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]])
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0, agg_mode="token-mean")
    _, metrics = policy_loss(new, old, adv, mask, config)
    ratio = new.exp()
    expected = torch.stack(
        [
            -1.0 * torch.minimum(ratio[0, 0], torch.tensor(1.3)),  # A>0: capped at 1 + high
            torch.maximum(ratio[0, 1], torch.tensor(0.8)),  # A<0, small ratio: floor at 1 - low
            ratio[0, 2],  # A<0, ratio 1.65 < c: plain
            torch.tensor(3.0),  # A<0, ratio e^2 > c: dual-clip bound c·|A|
        ]
    )
    loss, _ = policy_loss(new, old, adv, mask, config)
    assert torch.allclose(loss, expected.mean(), atol=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(new, old, adv, mask, PolicyLossConfig(clip_ratio_c=0.5))


def test_value_loss_takes_the_larger_of_clipped_and_unclipped() -> None:
    mask = torch.ones(1, 2)
    old = torch.tensor([[0.0, 0.0]])
    values = torch.tensor([[1.0, 0.1]])
    returns = torch.tensor([[2.0, 0.0]])
    loss, metrics = value_loss(values, returns, old, mask, clip_range=0.5)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 → 2.25; token 1: 0.01 both
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.01) / 2)
    assert metrics["critic/vf_clipfrac"].item() == pytest.approx(0.5)


def test_kl_estimators_and_whitening() -> None:
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), logp - ref)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), 0.5 * (logp - ref) ** 2)
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.all(k3 >= 0) and torch.allclose(k3, (ref - logp).exp() - (ref - logp) - 1)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(logp, ref, "k9")
    x, mask = torch.randn(4, 6), torch.ones(4, 6)
    w = masked_whiten(x, mask)
    assert abs(w.mean().item()) < 1e-5 and abs(w.std().item() - 1) < 1e-3


def test_every_estimator_feeds_every_policy_loss_mode() -> None:
    """Any estimator × any loss mode: compute_advantages' output trains every mode to a finite loss
    and gradient (the columns each estimator reads given: values, a baseline, Σπ², old log-probs, a
    teacher's log-probs)."""
    from hfrt.daemon.batch import Batch
    from hfrt.roles.components.advantage import Advantages
    from hfrt.wire.loss_options import ESTIMATORS, POLICY_LOSS_MODES

    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(4)[None] < torch.tensor([4, 2, 3, 4, 1, 3])[:, None]).float()
    scores = torch.zeros(6, 4)
    scores[torch.arange(6), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 1.0])
    old = -torch.rand(6, 4, generator=g) - 0.1
    batch = Batch({"response_mask": mask, "token_level_scores": scores, "old_log_probs": old, "values": torch.rand(6, 4, generator=g),
                   "sum_pi_squared": torch.rand(6, 4, generator=g) * 0.5, "baseline_score": torch.rand(6, generator=g),
                   "ref_log_prob": -torch.rand(6, 4, generator=g) - 0.1},  # on_policy_distill's teacher
                  {"uid": ["a", "a", "a", "b", "b", "b"]})
    for estimator in ESTIMATORS:
        adv = Advantages().compute(batch, estimator=estimator)["advantages"]
        assert torch.isfinite(adv).all() and adv.abs().sum() > 0, estimator
        for mode in POLICY_LOSS_MODES:
            log_prob = (old + 0.1 * torch.randn(6, 4, generator=g)).requires_grad_(True)
            loss, _ = policy_loss(log_prob, old, adv, mask, PolicyLossConfig(mode=mode, tis_cap=2.0, clip_cov_lb=-10.0),
                                  rollout_log_probs=old, generator=torch.Generator().manual_seed(0))
            loss.backward()
            assert log_prob.grad is not None, (estimator, mode)
            assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all(), (estimator, mode)
            assert log_prob.grad.abs().sum() > 0, (estimator, mode)
