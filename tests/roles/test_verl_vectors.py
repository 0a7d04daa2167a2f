"""hfrt against numbers produced by verl's own functions (verl_vectors.json: verl's core_algos and
rollout_corr_helper at commit b178a3c, run on these inputs): the sapo, gpg, geo_mean, clip_cov,
kl_cov and REINFORCE losses (value, gradient, metrics; with and without rollout weights), the
opo, grpo_passk, gpg and optimal-token-baseline estimators, and the rollout correction's weights,
rejection masks and metrics. Clip-Cov's pick used torch's global RNG seeded with `rng_seed`;
hfrt's generator seeded alike draws the same permutation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.roles.losses import PolicyLossConfig, policy_loss
from hfrt.roles.losses import advantages as adv_fns
from hfrt.roles.losses import token_baseline as otb_fns
from hfrt.roles.losses.corrections import is_weights, offpolicy_metrics, rejection_mask

VECTORS = json.loads((Path(__file__).parent / "verl_vectors.json").read_text())
T = torch.tensor
CONFIG = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "tau_pos": 1.0, "tau_neg": 1.05, "clip_cov_ratio": 0.2,
          "clip_cov_lb": -1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1}


def _inputs(seed: int) -> dict[str, Any]:
    raw = VECTORS["inputs"][seed]
    return {k: (v if k == "index" else T(v)) for k, v in raw.items()}


def _metrics_match(ours: dict[str, Any], theirs: dict[str, float], where: str) -> None:
    for key, value in theirs.items():
        if key not in ours:  # verl's constant zeros for modes that do not clip (hfrt leaves them out)
            assert value == 0.0, (where, key)
            continue
        assert float(ours[key]) == pytest.approx(value, abs=2e-5, rel=1e-4), (where, key)


@pytest.mark.parametrize("case", VECTORS["policy"], ids=lambda c: f"{c['mode']}-{c['agg']}-w{int(c['weighted'])}-s{c['seed']}")
def test_policy_losses_match_verl(case: dict[str, Any]) -> None:
    b = _inputs(case["seed"])
    mode = case["mode"]
    advantages = b["seq_adv"] if mode == "geo_mean" else b["adv"]
    old = b["rollout"] if mode == "reinforce" else b["old"]
    log_prob = b["logp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        log_prob, old, advantages, b["mask"], PolicyLossConfig(mode=mode, agg_mode=case["agg"], **CONFIG),  # type: ignore[arg-type]
        weights=b["weights"] if case["weighted"] else None, generator=torch.Generator().manual_seed(case["rng_seed"]))
    loss.backward()
    assert loss.item() == pytest.approx(case["loss"], abs=1e-5)
    assert log_prob.grad is not None and torch.allclose(log_prob.grad, T(case["grad"]), atol=1e-5)
    _metrics_match(metrics, case["metrics"], mode)


@pytest.mark.parametrize("case", VECTORS["estimators"], ids=lambda c: f"{c['name']}-s{c['seed']}")
def test_estimators_match_verl(case: dict[str, Any]) -> None:
    b = _inputs(case["seed"])
    name, *flags = case["name"].split("/")
    opts = dict(flag.split("=") for flag in flags)
    rewards, mask, index = b["rewards"], b["mask"], b["index"]
    if name == "grpo_passk":
        got, _ = adv_fns.compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std=opts["norm"] == "True")
    elif name == "opo":
        got, _ = adv_fns.compute_opo_outcome_advantage(rewards, mask, index)
    elif name == "gpg":
        got, _ = adv_fns.compute_gpg_outcome_advantage(rewards, mask, index)
    else:
        weights = b["weights"] if opts["is"] == "True" else None
        tail = opts["zero_tail"] == "True"
        if name == "optimal_token_baseline":
            got, _ = otb_fns.compute_optimal_token_baseline_advantage(rewards, mask, index, b["old"], b["spp"], weights, tail)
        else:
            holes = mask.clone()
            holes[:, 1] = 0  # a multi-turn mask: the second position is another turn's
            got, _ = otb_fns.compute_tir_optimal_token_baseline_advantage(rewards, holes, index, b["old"], b["spp"], weights, tail)
    assert torch.allclose(got, T(case["advantages"]), atol=1e-5), (got, case["advantages"])


@pytest.mark.parametrize("case", VECTORS["corrections"], ids=lambda c: f"{c['kind']}-{c.get('level', c.get('rollout_rs', ''))}-s{c['seed']}")
def test_rollout_correction_matches_verl(case: dict[str, Any]) -> None:
    b = _inputs(case["seed"])
    log_ratio = b["old"] - b["rollout"]
    if case["kind"] == "is":
        weights, metrics = is_weights(log_ratio, b["mask"], case["level"], case["threshold"], case["batch_normalize"])
        assert torch.allclose(weights, T(case["weights"]), atol=1e-5)
    elif case["kind"] == "rs":
        kept, metrics = rejection_mask(log_ratio, b["mask"], case["rollout_rs"], case["threshold"])
        assert torch.equal(kept, T(case["mask"]))
    else:
        metrics = offpolicy_metrics(b["old"], b["rollout"], b["mask"])
    _metrics_match(metrics, case["metrics"], case["kind"])
