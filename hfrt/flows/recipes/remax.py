"""The `remax` flow: ReMax (Li et al. 2023) on the built-in addition task — no critic; for every
prompt, n sampled responses and one greedy (temperature 0) response; each sample's advantage is
its reward-to-go minus its prompt's greedy reward. KL goes into the reward (rewards = scores −
β·KL(old ‖ ref), kl_coef=0.001), as in verl's ReMax example; n=1 as in the paper.

Both generations are sent at once and awaited together. The actor runs its calls in arrival
order (its `generate` is not a concurrent endpoint), so the greedy generation does not run beside
the sampled one on the actor: it runs while the samples' reference log-probs and reward scores
are computed on the other daemons, and no controller round trip separates the two generations.

The baseline is a per-row column the controller builds from inline values only: the greedy
scores (`score` is a non-tensor column) looked up by the prompt ids (`uid`) the controller gave
the prompts, in the rollout's own row order — so no tensor moves through the controller. It
knows role endpoints and column names, nothing of engines.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.grpo_family import GRPO_ROLES, RLOOConfig, actor_loss_options, experience, sample, train
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward

#: The embedded default: actor, reference and reward (no critic).
ROLES: dict[str, dict[str, Any]] = GRPO_ROLES
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate", "generate_greedy")}),
    (Stage.STAGE2, {"reference": ("forward",), "reward": ("forward", "forward_greedy")}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward",)}),
    (Stage.UPDATE, {"actor": ("train",)}),
)
#: The baseline column compute_advantages(estimator="remax") reads.
BASELINE = "baseline_score"


@dataclass(frozen=True)
class ReMaxConfig(RLOOConfig):
    """RLOOConfig (in-reward KL) with n=1 sampled response per prompt by default; the greedy
    response uses the same max_new_tokens."""

    prompts_per_step: int = 32
    n: int = 1

    def advantage_options(self) -> dict[str, Any]:
        return super().advantage_options() | {"estimator": "remax", "baseline_column": BASELINE}


Config = ReMaxConfig


async def flow(ctl: Any, config: ReMaxConfig | dict[str, Any]) -> dict[str, Any]:
    return await train(ctl, ReMaxConfig.read(config), remax_step)


async def remax_step(
    cfg: ReMaxConfig, step: int, prompts: BatchHandle, *, actor: Actor, reference: Reference, reward: Reward
) -> dict[str, Any]:
    """One ReMax step on a batch of prompts; returns its metrics."""
    t = StageTimer()
    prompts = keyed_prompts(prompts, step)
    # Stage 1: n sampled responses and one greedy response per prompt, both sent now
    samples = sample(actor, cfg, step, prompts)
    greedy = actor.generate(prompts, temperature=0.0, max_new_tokens=cfg.max_new_tokens)
    # Stage 2, as each arrives: the samples' reference log-probs ∥ reward; the greedy responses' reward
    (rollout, ref, scores), (greedy_rollout, greedy_scores) = await t.together(
        Stage.ROLLOUT, samples=experience(t, samples, reference=reference, reward=reward),
        greedy=scored(t, greedy, reward=reward))
    # Each sample's baseline: the greedy score of its prompt
    baseline = baseline_handle(rollout, greedy_rollout, greedy_scores)
    old = await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))
    # rewards = scores − β·KL; advantages = reward-to-go − baseline
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(
        rollout, scores, old, ref, baseline, **cfg.advantage_call(**cfg.advantage_options())))
    # Stage 3: actor training (no critic)
    actor_ranks = await t.one(Stage.UPDATE, actor.update(rollout, old, ref, adv, **actor_loss_options(cfg)))
    baseline_mean = statistics.fmean(float(s) for s in non_tensor(greedy_scores, "score"))
    return step_metrics(
        t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks), {"remax/baseline_mean": baseline_mean})


async def scored(t: StageTimer, greedy: Awaitable[BatchHandle], *, reward: Reward) -> tuple[BatchHandle, BatchHandle]:
    """(greedy rollout, its scores): `timing/greedy_generate_s` counts from when the greedy call
    was sent, so it includes its wait behind the sampled generation on the actor."""
    rollout = await t.one(Stage.GREEDY_GENERATE, greedy)
    return rollout, await t.one(Stage.GREEDY_REWARD, reward.score(rollout))


def keyed_prompts(prompts: BatchHandle, step: int) -> BatchHandle:
    """The prompts (non-tensor columns only) with a `uid` per prompt, "step:row", unique in the
    step: both generations carry it, so a sample finds its greedy twin by uid, not by position.
    Replaces a `uid` the data may have."""
    tensors = [name for shard in prompts.shards for name in shard.columns]
    if tensors:
        raise ValueError(f"remax: prompts must be non-tensor columns only; they have tensor columns {sorted(set(tensors))}")
    names = {name: None for shard in prompts.shards for name in shard.non_tensor}
    columns = {name: non_tensor(prompts, name) for name in names}
    return prompts_handle(columns | {"uid": [f"{step}:{row}" for row in range(len(prompts))]})


def baseline_column(sample_uids: Sequence[Hashable], greedy_uids: Sequence[Hashable], greedy_scores: Sequence[float]) -> list[float]:
    """Row by row for the samples: the greedy score of the prompt whose uid the sample carries."""
    by_uid = dict(zip(greedy_uids, (float(s) for s in greedy_scores), strict=True))
    if len(by_uid) != len(greedy_uids):
        raise ValueError(f"remax: the greedy rollout repeats a uid ({len(greedy_uids)} rows, {len(by_uid)} uids)")
    missing = sorted({str(u) for u in sample_uids if u not in by_uid})
    if missing:
        raise ValueError(f"remax: samples of prompt uid(s) {missing[:5]} have no greedy response")
    return [by_uid[u] for u in sample_uids]


def baseline_handle(rollout: BatchHandle, greedy: BatchHandle, greedy_scores: BatchHandle) -> BatchHandle:
    """A one-column batch made in the controller, `baseline_score`, aligned row for row with
    `rollout` (built from its own `uid` column in its shard order), to pass to compute_advantages
    beside it. Reads inline non-tensor columns only."""
    values = baseline_column(non_tensor(rollout, "uid"), non_tensor(greedy, "uid"), non_tensor(greedy_scores, "score"))
    if len(values) != len(rollout):
        raise ValueError(f"remax: the rollout has {len(rollout)} rows but {len(values)} uids")
    return prompts_handle({BASELINE: values})
