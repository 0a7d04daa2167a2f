"""reduce_rank_metrics: one metrics dict from the per-rank dicts of a split endpoint (`update`), and
the flows' steps using it (on fake two-rank roles: pure controller logic)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from hfrt.flows.grpo_family import GRPOConfig
from hfrt.flows.metrics import reduce_rank_metrics
from hfrt.flows.ppo_family import PPOConfig
from hfrt.flows.recipes.grpo import grpo_step
from hfrt.flows.recipes.ppo import ppo_step
from hfrt.protocols import BatchHandle


def rank(loss: float, seconds: float, rss_mb: float) -> dict[str, float]:
    """What one rank of actor.update returns: loss terms, lr and the step count already reduced
    over the group (equal on every rank), its own timing and memory."""
    return {
        "actor/loss": loss, "actor/grad_norm": 0.75, "actor/lr": 2e-3, "actor/optimizer_steps": 2.0,
        "timing/update_actor_s": seconds, "memory/peak_rss_mb": rss_mb,
        "rollout/timing/generate_s": seconds * 2, "rollout/memory/peak_rss_mb": rss_mb + 1,
    }


def test_global_values_are_not_counted_once_per_rank() -> None:
    out = reduce_rank_metrics([rank(0.1, 1.0, 100.0), rank(0.1, 3.0, 90.0)])
    # the group made 2 optimizer steps at lr 2e-3, not 4 at 4e-3
    assert out["actor/optimizer_steps"] == 2.0 and out["actor/lr"] == 2e-3
    assert out["actor/loss"] == 0.1 and out["actor/grad_norm"] == 0.75  # exactly, not 0.1 ± rounding


def test_timing_and_memory_take_the_largest_rank() -> None:
    out = reduce_rank_metrics([rank(0.1, 1.0, 100.0), rank(0.1, 3.0, 90.0)])
    assert out["timing/update_actor_s"] == 3.0 and out["memory/peak_rss_mb"] == 100.0
    assert out["rollout/timing/generate_s"] == 6.0 and out["rollout/memory/peak_rss_mb"] == 101.0


def test_values_that_differ_by_rank_are_averaged() -> None:
    out = reduce_rank_metrics([rank(0.1, 1.0, 100.0), rank(0.3, 1.0, 100.0), rank(0.5, 1.0, 100.0)])
    assert math.isclose(out["actor/loss"], 0.3)


def test_one_rank_passes_through() -> None:
    one = rank(0.25, 1.5, 80.0)
    assert reduce_rank_metrics([one]) == one


def test_keys_that_differ_between_ranks_are_named() -> None:
    other = rank(0.1, 1.0, 100.0)
    del other["actor/grad_norm"]
    with pytest.raises(ValueError, match=r"rank 1 .*\['actor/grad_norm'\]"):
        reduce_rank_metrics([rank(0.1, 1.0, 100.0), other])


def test_no_ranks_is_an_error() -> None:
    with pytest.raises(ValueError, match="no per-rank metrics"):
        reduce_rank_metrics([])


class FakeRole:
    """A role group whose endpoints answer at once with canned results (what two ranks return)."""

    def __init__(self, **results: Any) -> None:
        self.results = results

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            return self.results[name]

        return call


def two_ranks(prefix: str) -> list[dict[str, float]]:
    return [{f"{prefix}/loss": 0.5, f"{prefix}/optimizer_steps": 1.0, f"timing/update_{prefix}_s": s} for s in (0.2, 0.3)]


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_a_flow_step_reduces_two_ranks_of_update_metrics(name: str) -> None:
    """What crashed with two actor ranks (`[actor_m] = await actor.update(...)` unpacked two
    dicts), on fake roles: the step's record holds the group's metrics, reduced once."""
    rollout = BatchHandle.inline({"prompt": ["1+1=", "2+0="]}, {"response_tokens": 4.0})
    handle = BatchHandle.inline({})
    actor = FakeRole(generate=rollout, compute_log_prob=handle, update=two_ranks("actor"),
                     compute_advantages=BatchHandle.inline({}, {"metrics": {"advantages/mean": 0.0}}))
    roles = {"actor": actor, "reference": FakeRole(compute_log_prob=handle),
             "reward": FakeRole(score=BatchHandle.inline({"score": [1.0, 0.0]}))}
    if name == "ppo":
        roles["critic"] = FakeRole(compute_values=handle, update=two_ranks("critic"))
        record = asyncio.run(ppo_step(PPOConfig(), 0, handle, **roles))
    else:
        record = asyncio.run(grpo_step(GRPOConfig(), 0, handle, **roles))
    assert record["actor/optimizer_steps"] == 1.0 and record["actor/loss"] == 0.5
    assert record["timing/update_actor_s"] == 0.3 and record["reward/mean"] == 0.5
    if name == "ppo":
        assert record["critic/optimizer_steps"] == 1.0 and record["timing/update_critic_s"] == 0.3
