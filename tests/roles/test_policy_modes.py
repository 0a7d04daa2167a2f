"""verl's newer policy losses (sapo, gpg, geo_mean, clip_cov, kl_cov, reinforce): small cases
worked out by hand, and for each a gradient check — the loss and its gradient equal autograd of
the objective written out independently here. Also verl's fixed aggregation of GSPO / SAPO and
its named alternative, and Clip-Cov's seeded pick."""

from __future__ import annotations

import math

import pytest
import torch

from hfrt.roles.losses import LossScale, PolicyLossConfig, agg_loss, policy_loss

T = torch.tensor


def _case(seed: int = 0) -> dict[str, torch.Tensor]:
    """4 × 5 with rows of 5, 3, 4, 2 tokens; log-ratios ~0.3 so some ratios leave [0.8, 1.28]."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(5)[None] < T([5, 3, 4, 2])[:, None]).float()
    old = -torch.rand(4, 5, generator=g) * 2
    return {
        "mask": mask, "old": old, "new": old + torch.randn(4, 5, generator=g) * 0.3,
        "adv": torch.randn(4, 5, generator=g) * mask, "rollout": old + torch.randn(4, 5, generator=g) * 0.2,
    }


def _grad(fn, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    x = new.clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    assert x.grad is not None
    return loss.detach(), x.grad


def _same(mode: str, objective, b: dict[str, torch.Tensor], **cfg: object) -> None:  # type: ignore[no-untyped-def]
    """policy_loss of `mode` has the value and gradient of `objective(new)`."""
    config = PolicyLossConfig(mode=mode, **cfg)  # type: ignore[arg-type]
    got, got_grad = _grad(lambda x: policy_loss(x, b["old"], b["adv"], b["mask"], config)[0], b["new"])
    want, want_grad = _grad(objective, b["new"])
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    assert torch.allclose(got_grad, want_grad, atol=1e-6)
    assert (got_grad[b["mask"] == 0] == 0).all()


def _seq_mean_token_mean(mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((mat * mask).sum(-1) / mask.sum(-1)).mean()


# -------------------------------------------------------------------- SAPO


def test_sapo_gate_by_hand() -> None:
    """f(r) = σ(τ(r − 1))·4/τ: at r = 1 it is 2/τ; τ is tau_pos for A > 0, tau_neg otherwise."""
    mask, old = torch.ones(1, 3), torch.zeros(1, 3)
    new = T([[0.0, 0.0, math.log(2.0)]])
    adv = T([[1.0, -1.0, 1.0]])
    loss, metrics = policy_loss(new, old, adv, mask, PolicyLossConfig(mode="sapo", tau_pos=1.0, tau_neg=2.0))
    gates = [2.0, 4.0 / (1 + math.exp(0)) / 2.0, 4.0 / (1 + math.exp(-1.0))]  # 2/1, σ(0)·4/2 = 1, σ(1)·4
    assert loss.item() == pytest.approx(-(gates[0] - gates[1] + gates[2]) / 3, abs=1e-6)
    assert metrics["actor/pg_clipfrac"].item() == 0.0  # nothing is clipped (verl reports 0)


def test_sapo_gradient_is_its_objective_aggregated_per_sequence() -> None:
    b = _case(1)
    tau = torch.where(b["adv"] > 0, 1.0, 1.05)

    def objective(x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(tau * (torch.exp(x - b["old"]) - 1)) * 4 / tau
        return _seq_mean_token_mean(-gate * b["adv"], b["mask"])

    _same("sapo", objective, b)  # token-mean asked for, seq-mean-token-mean used (verl)


def test_gspo_and_sapo_keep_loss_agg_mode_only_when_asked() -> None:
    b = _case(2)
    for mode in ("gspo", "sapo"):
        fixed = policy_loss(b["new"], b["old"], b["adv"], b["mask"], PolicyLossConfig(mode=mode, agg_mode="token-mean"))[0]
        seq = policy_loss(b["new"], b["old"], b["adv"], b["mask"], PolicyLossConfig(mode=mode, agg_mode="seq-mean-token-mean"))[0]
        kept = policy_loss(b["new"], b["old"], b["adv"], b["mask"],
                           PolicyLossConfig(mode=mode, agg_mode="token-mean", keep_loss_agg_mode=True))[0]
        assert torch.allclose(fixed, seq) and not torch.allclose(fixed, kept), mode


# -------------------------------------------------------------------- GPG and REINFORCE


def test_gpg_and_reinforce_are_minus_advantage_times_logp() -> None:
    b = _case(3)
    for mode in ("gpg", "reinforce"):
        _same(mode, lambda x: agg_loss(-x * b["adv"], b["mask"], "token-mean"), b)
    _, metrics = policy_loss(b["new"], b["rollout"], b["adv"], b["mask"], PolicyLossConfig(mode="reinforce"))
    kl = ((b["rollout"] - b["new"]) * b["mask"]).sum() / b["mask"].sum()
    assert metrics["actor/ppo_kl"].item() == pytest.approx(kl.item(), abs=1e-6)
    assert policy_loss(b["new"], b["old"], b["adv"], b["mask"], PolicyLossConfig(mode="gpg"))[1] == {}


def test_reinforce_with_weights_has_the_gradient_of_the_ratio() -> None:
    """Bypass mode: w = π_θ / π_rollout detached, −w·A·logp has the gradient of −A·π_θ/π_rollout."""
    b = _case(4)
    w = torch.exp(b["new"] - b["rollout"]) * b["mask"]
    config = PolicyLossConfig(mode="reinforce")
    _, got = _grad(lambda x: policy_loss(x, b["rollout"], b["adv"], b["mask"], config, weights=w)[0], b["new"])
    _, want = _grad(lambda x: agg_loss(-b["adv"] * torch.exp(x - b["rollout"]), b["mask"], "token-mean"), b["new"])
    assert torch.allclose(got, want, atol=1e-6)


# -------------------------------------------------------------------- GMPO


def test_geo_mean_by_hand() -> None:
    """One sequence, A = 1: log-ratios 0.5 (clipped to 0.28) and −0.5 (kept: the pessimistic side
    for A > 0 is the lower one); ratio exp((0.28 − 0.5)/2); the loss −1·ratio."""
    mask, old = torch.ones(1, 2), torch.zeros(1, 2)
    new, adv = T([[0.5, -0.5]]), T([[1.0, 1.0]])
    loss, metrics = policy_loss(new, old, adv, mask, PolicyLossConfig(mode="geo_mean", clip_ratio_high=0.28))
    assert loss.item() == pytest.approx(-math.exp((0.28 - 0.5) / 2), abs=1e-6)
    # both tokens leave [−0.2, 0.28], both with A > 0
    assert metrics["actor/pg_clipfrac"].item() == 1.0 and metrics["actor/pg_clipfrac_lower"].item() == 0.0


def test_geo_mean_gradient_is_its_objective() -> None:
    b = _case(5)
    adv = torch.randn(4, 1, generator=torch.Generator().manual_seed(9)).expand(4, 5) * b["mask"]  # a sequence advantage
    b = b | {"adv": adv}
    low, high = 0.2, 0.28

    def objective(x: torch.Tensor) -> torch.Tensor:
        r = x - b["old"]
        sign = torch.sign(adv)
        pessimistic = sign * torch.minimum(sign * r, sign * r.clamp(-low, high))
        n = b["mask"].sum(-1)
        ratio = torch.exp((pessimistic * b["mask"]).sum(-1) / n)
        return (-(adv * b["mask"]).sum(-1) / n * ratio).mean()

    _same("geo_mean", objective, b, clip_ratio_low=low, clip_ratio_high=high)


def test_geo_mean_shares_add_up_over_micro_batches() -> None:
    b = _case(6)
    config = PolicyLossConfig(mode="geo_mean")
    whole = policy_loss(b["new"], b["old"], b["adv"], b["mask"], config)[0]
    scale = LossScale(float(b["mask"].sum()), 4.0, 1)
    parts = [policy_loss(b["new"][s], b["old"][s], b["adv"][s], b["mask"][s], config, scale)[0] for s in (slice(0, 1), slice(1, 4))]
    assert torch.allclose(sum(parts), whole, atol=1e-6)  # type: ignore[arg-type]


# -------------------------------------------------------------------- Clip-Cov and KL-Cov


def _cov_case() -> dict[str, torch.Tensor]:
    """One row of 4 tokens, ratio 1 everywhere (nothing PPO-clipped): A = [2, −2, 0, 0],
    logp = [−1, −3, −2, −2] → cov = (A − 0)(logp − (−2)) = [2, 2, 0, 0]."""
    logp = T([[-1.0, -3.0, -2.0, -2.0]])
    return {"mask": torch.ones(1, 4), "old": logp.clone(), "new": logp, "adv": T([[2.0, -2.0, 0.0, 0.0]])}


def test_clip_cov_cuts_the_gradient_of_one_high_covariance_token() -> None:
    b = _cov_case()
    config = PolicyLossConfig(mode="clip_cov", clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)  # max(1, ⌊0.25·4⌋) = 1
    picks = set()
    for seed in range(8):
        loss, grad = _grad(lambda x, seed=seed: policy_loss(x, b["old"], b["adv"], b["mask"], config,
                                                           generator=torch.Generator().manual_seed(seed))[0], b["new"])
        cut = (grad[0, :2] == 0).nonzero().flatten().tolist()
        assert len(cut) == 1  # exactly one of the two tokens with cov in (1, 5)
        picks.add(cut[0])
        kept = 1 - cut[0]
        assert grad[0, kept].item() == pytest.approx(-b["adv"][0, kept].item() / 4)  # −A·r·∂logp / tokens
        assert loss.item() == pytest.approx(-b["adv"][0, kept].item() / 4)
    assert picks == {0, 1}  # the pick is random...
    again = [policy_loss(b["new"], b["old"], b["adv"], b["mask"], config, generator=torch.Generator().manual_seed(3))[0]
             for _ in range(2)]
    assert torch.equal(again[0], again[1])  # ...and a seed repeats it
    _, metrics = policy_loss(b["new"], b["old"], b["adv"], b["mask"], config, generator=torch.Generator().manual_seed(0))
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.25)


def test_clip_cov_gradient_is_ppo_times_its_mask() -> None:
    b = _case(7)
    config = PolicyLossConfig(mode="clip_cov", clip_cov_ratio=0.3, clip_cov_lb=-1.0, clip_cov_ub=5.0, clip_ratio_c=None)
    loss, grad = _grad(lambda x: policy_loss(x, b["old"], b["adv"], b["mask"], config,
                                             generator=torch.Generator().manual_seed(1))[0], b["new"])
    vanilla = PolicyLossConfig(clip_ratio_c=None)
    _, full = _grad(lambda x: policy_loss(x, b["old"], b["adv"], b["mask"], vanilla)[0], b["new"])
    cut = (grad == 0) & (full != 0)
    assert cut.sum() == max(int(0.3 * b["mask"].sum()), 1)  # ⌊0.3 · 14⌋ = 4 tokens cut
    assert torch.allclose(grad[~cut], full[~cut], atol=1e-6)


def test_kl_cov_penalises_the_top_covariance_tokens() -> None:
    b = _cov_case()
    b["new"] = b["new"] + T([[0.1, 0.0, 0.0, 0.0]])  # token 0: log-ratio 0.1
    config = PolicyLossConfig(mode="kl_cov", kl_cov_ratio=0.25, ppo_kl_coef=0.5)
    loss, metrics = policy_loss(b["new"], b["old"], b["adv"], b["mask"], config)
    # logp mean −1.975: cov = [2·1.075, −2·(−1.025), 0, 0] = [2.15, 2.05, 0, 0]; token 0 pays 0.5·|0.1|
    r0 = math.exp(0.1)
    assert loss.item() == pytest.approx((-2 * r0 + 0.05 + 2.0) / 4, abs=1e-6)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(0.1 / 4)  # verl's: the mean |log ratio|

    def objective(x: torch.Tensor) -> torch.Tensor:
        r = torch.exp(x - b["old"])
        penalty = T([[0.5, 0.0, 0.0, 0.0]]) * (x - b["old"]).abs()
        return (-b["adv"] * r + penalty).mean()

    _same("kl_cov", objective, b, kl_cov_ratio=0.25, ppo_kl_coef=0.5)


def test_rollout_weights_multiply_every_token_loss() -> None:
    """Weights w scale each token's loss before aggregation (geo_mean: by their geometric mean per
    sequence): w = c everywhere scales every mode's loss by c, and w = 1 changes nothing."""
    b = _case(8)
    for mode in ("vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean", "kl_cov", "reinforce"):
        config = PolicyLossConfig(mode=mode)
        plain = policy_loss(b["new"], b["old"], b["adv"], b["mask"], config)[0]
        ones = policy_loss(b["new"], b["old"], b["adv"], b["mask"], config, weights=torch.ones(4, 5))[0]
        thrice = policy_loss(b["new"], b["old"], b["adv"], b["mask"], config, weights=torch.full((4, 5), 3.0))[0]
        assert torch.allclose(ones, plain, atol=1e-6) and torch.allclose(thrice, 3 * plain, atol=1e-5), mode
