"""The `dapo` flow: DAPO (Yu et al. 2025) on the built-in addition task — GRPO groups of n samples
per prompt with clip-higher (ratio clipped to [1 − 0.2, 1 + 0.28]), token-mean loss, no KL term
(kl/mean is still logged), soft
overlong punishment and dynamic sampling. A step::

    repeat (at most max_gen_batches rounds, each on prompts_per_step new prompts):
        generate n per prompt → (reward scores ∥ reference log-probs, for kl/mean and the KL loss)
        keep the groups whose scores are not all equal
    until prompts_per_step groups are kept; trim to prompts_per_step groups
    old log-probs → advantages (GRPO, + overlong penalty, on the actor's rank 0) → actor update

Selection moves no bytes: a group's samples are adjacent rows (one uid), so the kept groups are
row ranges, and the same ranges are sliced out of the rollout and of every stage-2 result and
concatenated (BatchHandle arithmetic). Groups are filtered on the reward role's scores, before
the overlong penalty (DAPO filters on accuracy, which the penalty does not change); the penalty is
added daemon-side by `compute_advantages` from each response's length in its response_mask.
Rounds after the first draw prompts from the Trainer's data source (`Trainer.more_prompts`).
A step's reward/* metrics are over every sample it generated, kept or not.
The controller knows handles, per-row scores and uids; nothing of engines, and it imports no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hfrt.flows.batches import non_tensor
from hfrt.flows.grpo_family import GRPO_ROLES, GRPOConfig, actor_loss_options
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward

#: The embedded default: GRPO's roles. DAPO drops the KL term (kl_loss_coef 0); the reference is
#: still there so every step logs kl/mean — how far the policy has moved — beside the reward.
ROLES: dict[str, dict[str, Any]] = dict(GRPO_ROLES)
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
#: One sampling round: DAPO repeats generate and stage2 until enough groups vary.
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"reward": ("forward",), "reference": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward",)}),
    (Stage.UPDATE, {"actor": ("train",)}),
)
Rows = tuple[int, int]


@dataclass(frozen=True)
class DAPOConfig(GRPOConfig):
    """GRPOConfig with DAPO's defaults (no KL loss, token-mean) plus clip-higher, dynamic sampling
    and the overlong punishment: with max_new_tokens M and overlong_buffer_len L, a response of
    length l > M − L gets −(l − (M − L))/L·overlong_penalty_factor added to its score."""

    max_new_tokens: int = 4
    kl_loss_coef: float = 0.0
    #: the policy ratio's lower clip, 1 − clip_ratio_low
    clip_ratio_low: float = 0.2
    #: the policy ratio's upper clip, 1 + clip_ratio_high (clip-higher: above clip_ratio_low)
    clip_ratio_high: float = 0.28
    #: dynamic sampling's generation rounds per step at most (≥ 1)
    max_gen_batches: int = 3
    #: the overlong buffer L: the last L tokens before max_new_tokens are punished (0: off; ≤ max_new_tokens)
    overlong_buffer_len: int = 2
    #: the overlong penalty at max_new_tokens (it grows linearly over the buffer)
    overlong_penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n < 2:
            raise ValueError(f"config n={self.n!r}: dynamic sampling needs groups of at least 2")
        if self.max_gen_batches < 1:
            raise ValueError(f"config max_gen_batches={self.max_gen_batches!r}: must be at least 1")
        if not 0 <= self.overlong_buffer_len <= self.max_new_tokens:
            raise ValueError(f"config overlong_buffer_len={self.overlong_buffer_len!r}: must be in [0, max_new_tokens]")
        for name in ("clip_ratio_low", "clip_ratio_high", "overlong_penalty_factor", "kl_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"config {name}={getattr(self, name)!r}: must not be negative")

    def flow_actor_options(self) -> dict[str, Any]:
        """GRPO's, plus clip-higher."""
        return super().flow_actor_options() | {"clip_ratio_low": self.clip_ratio_low, "clip_ratio_high": self.clip_ratio_high}


Config = DAPOConfig


async def flow(ctl: Any, config: DAPOConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = DAPOConfig.read(config)
    roles = await get_roles(ctl, "actor", "reward", "reference")
    trainer = Trainer(ctl, cfg, roles)
    return await trainer.run(lambda step, prompts: dapo_step(cfg, step, prompts, trainer.more_prompts, **roles))


# -- group selection (pure row arithmetic) ---------------------------------------------------


def group_ranges(uids: Sequence[Hashable]) -> list[Rows]:
    """The row range [start, stop) of each group: a run of one uid (a prompt's samples are
    adjacent rows); ValueError when a uid shows up again after its run ended."""
    ranges: list[Rows] = []
    seen: set[Hashable] = set()
    for row, uid in enumerate(uids):
        if ranges and uids[ranges[-1][0]] == uid:
            ranges[-1] = (ranges[-1][0], row + 1)
            continue
        if uid in seen:
            raise ValueError(f"group {uid!r} is not in adjacent rows (again at row {row})")
        seen.add(uid)
        ranges.append((row, row + 1))
    return ranges


def varied_groups(scores: Sequence[float], groups: Sequence[Rows]) -> list[Rows]:
    """The groups whose scores are not all equal (std > 0): the others give GRPO no gradient."""
    return [(a, b) for a, b in groups if max(scores[a:b]) > min(scores[a:b])]


def coalesce(ranges: Sequence[Rows]) -> list[Rows]:
    """Sorted row ranges with touching neighbours joined ([(0, 2), (2, 4)] → [(0, 4)])."""
    out: list[Rows] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def select_rows(handle: BatchHandle, ranges: Sequence[Rows]) -> BatchHandle:
    """The rows in `ranges` of a batch handle, as one handle over the same stored tensors."""
    return BatchHandle.concat([handle.slice(a, b) for a, b in coalesce(ranges)])


# -- the step ---------------------------------------------------------------------------------


@dataclass
class Round:
    """One generation round: its rollout, its stage-2 results (`ref` None without KL) and the
    row ranges of the groups it keeps."""

    rollout: BatchHandle
    scores: BatchHandle
    ref: BatchHandle | None
    kept: list[Rows]

    def select(self) -> tuple[BatchHandle, BatchHandle, BatchHandle | None]:
        """The kept rows of the rollout and of each stage-2 result (the same ranges)."""
        ref = select_rows(self.ref, self.kept) if self.ref is not None else None
        return select_rows(self.rollout, self.kept), select_rows(self.scores, self.kept), ref


async def sample_round(cfg: DAPOConfig, step: int, index: int, prompts: BatchHandle, t: StageTimer,
                       actor: Actor, reward: Reward, reference: Reference | None) -> Round:
    """Generate n samples per prompt, score them (reference log-probs alongside when there is a
    KL term) and find the groups with varied scores; stage times add up over rounds."""
    rt = StageTimer()
    rollout = await rt.one(Stage.GENERATE, actor.generate(
        prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        seed=sampling_seed(cfg, step) + index * 7_919_993))
    calls = {"reward": reward.score(rollout)}
    if reference is not None:
        calls["ref_log_prob"] = reference.compute_log_prob(rollout)
    scores, *ref = await rt.together(Stage.STAGE2, **calls)
    for name, seconds in rt.timings.items():
        t.timings[name] = t.timings.get(name, 0.0) + seconds
    t.stages += [stage for stage in rt.stages if stage not in t.stages]
    groups = group_ranges(non_tensor(rollout, "uid"))
    kept = varied_groups([float(s) for s in non_tensor(scores, "score")], groups)
    return Round(rollout, scores, ref[0] if ref else None, kept)


async def dapo_step(cfg: DAPOConfig, step: int, prompts: BatchHandle, more_prompts: Callable[[int], BatchHandle], *,
                    actor: Actor, reward: Reward, reference: Reference | None = None) -> dict[str, Any]:
    """One DAPO step: dynamic sampling over up to max_gen_batches rounds, then training on the
    kept groups (at most prompts_per_step); returns its metrics."""
    t = StageTimer()
    # Stage 1 + 2, repeated: sample and score until enough groups have varied rewards
    rounds: list[Round] = []
    kept = 0
    while kept < cfg.prompts_per_step and len(rounds) < cfg.max_gen_batches:
        batch = prompts if not rounds else more_prompts(cfg.prompts_per_step)
        r = await sample_round(cfg, step, len(rounds), batch, t, actor, reward, reference)
        r.kept = r.kept[: cfg.prompts_per_step - kept]
        kept += len(r.kept)
        rounds.append(r)
    every = BatchHandle.concat([r.rollout for r in rounds])
    every_rollout = BatchHandle(every.shards, merged_rollout_meta([r.rollout for r in rounds]), (every,))
    every_score = BatchHandle.concat([r.scores for r in rounds])
    metrics = dapo_metrics(rounds)
    if not kept:  # nothing to learn from: every group scored alike in every round
        return step_metrics(t, every_score, every_rollout, metrics)
    parts = [r.select() for r in rounds if r.kept]
    rollout, scores = BatchHandle.concat([p[0] for p in parts]), BatchHandle.concat([p[1] for p in parts])
    ref = [BatchHandle.concat([p[2] for p in parts if p[2] is not None])] if reference is not None else []
    # Stage 3: old log-probs, advantages (GRPO + overlong penalty), actor update on the kept groups
    old = await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(rollout, scores, old, *ref, **cfg.advantage_call(
        estimator="grpo", norm_adv_by_std=cfg.norm_adv_by_std, overlong_buffer_len=cfg.overlong_buffer_len,
        overlong_penalty_factor=cfg.overlong_penalty_factor, max_response_len=cfg.max_new_tokens)))
    loss = actor_loss_options(cfg)  # with DAPO's clip-higher ratios (DAPOConfig.flow_actor_options)
    actor_ranks = await t.one(Stage.UPDATE, actor.update(rollout, old, *ref, adv, **loss))
    adv_m = dict(adv.meta["metrics"])
    metrics["dapo/overlong_penalty_mean"] = adv_m.pop("overlong/penalty_mean", 0.0)
    metrics["dapo/kept_reward_mean"] = statistics.fmean(float(s) for s in non_tensor(scores, "score"))
    return step_metrics(t, every_score, every_rollout, adv_m, reduce_rank_metrics(actor_ranks), metrics)


def dapo_metrics(rounds: Sequence[Round]) -> dict[str, float]:
    """dapo/gen_batches, kept_groups, generated_groups, and the smallest score std of a kept group
    (dapo/kept_min_group_std: > 0 whenever a group was kept; 0 when none was). dapo_step adds the
    kept rows' mean score (kept_reward_mean) and their mean overlong penalty."""
    stds = []
    for r in rounds:
        scores = [float(s) for s in non_tensor(r.scores, "score")]
        stds += [statistics.pstdev(scores[a:b]) for a, b in r.kept]
    generated = sum(len(group_ranges(non_tensor(r.rollout, "uid"))) for r in rounds)
    return {
        "dapo/gen_batches": float(len(rounds)), "dapo/kept_groups": float(len(stds)),
        "dapo/generated_groups": float(generated), "dapo/kept_min_group_std": min(stds, default=0.0),
        "dapo/overlong_penalty_mean": 0.0,
    }


def merged_rollout_meta(rollouts: Sequence[BatchHandle]) -> dict[str, Any]:
    """One meta for several rounds' rollouts: times and token counts add up, extremes are the
    extremes, mean length and clip share are weighted by rows; other keys are the first round's."""
    metas: list[Mapping[str, Any]] = [r.meta for r in rollouts]
    rows = [len(r) for r in rollouts]

    def each(key: str) -> list[float]:
        return [float(m.get(key, 0.0)) for m in metas]

    out = dict(metas[0])
    for key in out:
        if key.startswith("timing/") or key == "response_tokens":
            out[key] = sum(each(key))
        elif key.startswith("memory/") or key == "response_length/max":
            out[key] = max(each(key))
        elif key == "response_length/min":
            out[key] = min(each(key))
        elif key in ("response_length/mean", "response_length/clip_ratio"):
            out[key] = sum(v * n for v, n in zip(each(key), rows, strict=True)) / max(sum(rows), 1)
    return out
