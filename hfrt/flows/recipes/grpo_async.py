"""The `grpo_async` flow: GRPO with generation on a separate `rollout` role that runs ahead of
training by up to `max_staleness` policy versions, the actor's weights pushed to it (bucketed,
checksummed, by handle) after every update, off-policy tokens corrected with truncated importance
sampling against the rollout engine's own log-probs (`tis_cap`).

A step: take the rollout started up to max_staleness steps ago (await late) → (reference log-probs
∥ reward scores; with early_stage2 started as soon as the rollout was there) → old log-probs → advantages → actor update → publish the new version and start
the next rollouts (start early). max_staleness=0 is the synchronous `grpo` flow, sample for sample.
It knows role endpoints and their options, nothing of engines or devices.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from hfrt.flows.common import CALL_TIMEOUT_S, StageTimer, get_roles, reduce_rank_metrics, step_metrics
from hfrt.flows.pipeline import STALE_POLICIES, RolloutPipeline, StalenessPolicy, WeightSync, partial_rollout
from hfrt.flows.recipes.grpo import ROLES as GRPO_ROLES
from hfrt.flows.recipes.grpo import GRPOFlowConfig, actor_loss_options
from hfrt.flows.trainer import Trainer, sampling_seed
from hfrt.protocols import BatchHandle

#: grpo's roles plus one generation-only rollout daemon with the actor's model and sampling.
ROLES: dict[str, dict[str, Any]] = {
    **GRPO_ROLES,
    "rollout": {"impl": "rollout", "options": {"model": "tiny", "sampling": {"top_k": 0}}},
}

#: The step's stages for `hfrt plan` (as in grpo, generation on the rollout role, plus the sync).
STAGES: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("generate", {"rollout": ("generate",)}),
    ("stage2", {"reference": ("forward",), "reward": ("forward",)}),
    ("old_log_prob", {"actor": ("forward",)}),
    ("update", {"actor": ("train",)}),
)


@dataclass(frozen=True)
class GRPOAsyncConfig(GRPOFlowConfig):
    """grpo's settings plus max_staleness (policy versions a sample may lag; 0: synchronous),
    stale_policy ("wait": rollouts never run further ahead than the bound; "drop": `rollout_ahead`
    rollouts stay in flight and samples found too old are generated again), rollout_ahead (-1:
    max_staleness), stale_min_keep (under "drop": too-old prompt groups are dropped one by one;
    when fewer than this share of a step's groups survive, the dropped prompts are generated again)
    and sync_bucket_mb (weight-sync bucket size). partial_rollout_tokens K > 0: rollouts are
    generated K new tokens at a time and a weight sync in between resumes the unfinished rows with
    the new weights (0: off). early_stage2: start a rollout's reference log-probs and reward scores
    as soon as it is generated (while the actor still trains the step before): worth it when the
    reference and reward daemons have devices of their own (e.g. on the generation pool); beside
    the actor they only take its time. tis_cap > 0 weights each token's loss by min(π_old / π_rollout,
    tis_cap) with the rollout engine's log-probs (policy_loss_mode=decoupled: decoupled PPO)."""

    max_staleness: int = 1
    stale_policy: str = "wait"
    rollout_ahead: int = -1
    stale_min_keep: float = 0.5
    sync_bucket_mb: float = 64.0
    partial_rollout_tokens: int = 0
    early_stage2: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_pipeline_settings(self)
        if self.partial_rollout_tokens < 0:
            raise ValueError(f"config partial_rollout_tokens={self.partial_rollout_tokens!r}: must be >= 0 (0: off)")

    def staleness(self) -> StalenessPolicy:
        return StalenessPolicy(self.max_staleness, self.stale_policy, self.rollout_ahead, self.stale_min_keep)


Config = GRPOAsyncConfig


async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    cfg = GRPOAsyncConfig.read(config)
    roles = await get_roles(ctl, "actor", "rollout", "reference", "reward")
    trainer = Trainer(ctl, cfg, roles)
    return await run_and_close(trainer, AsyncGRPO(cfg, roles, trainer))


async def run_and_close(trainer: Trainer, steps: Any) -> dict[str, Any]:
    """`trainer.run(steps)`, then `steps.close()` — `close(abort=True)` if the run raised (the
    first error is the one reported): for step functions that keep work going between steps."""
    try:
        summary = await trainer.run(steps)
    except BaseException:
        await steps.close(abort=True)
        raise
    await steps.close()
    return summary


class PipelineConfig(Protocol):
    """What PipelinedSteps reads of a flow's settings (GRPOAsyncConfig, AgentCalcConfig)."""

    @property
    def steps(self) -> int: ...
    @property
    def prompts_per_step(self) -> int: ...
    @property
    def sync_bucket_mb(self) -> float: ...
    @property
    def stale_policy(self) -> str: ...

    def staleness(self) -> StalenessPolicy: ...


def check_pipeline_settings(cfg: PipelineConfig) -> None:
    """Refuse a flow's pipeline settings (stale_policy, sync_bucket_mb, the staleness bound) that
    cannot work, naming the setting."""
    if cfg.stale_policy not in STALE_POLICIES:
        raise ValueError(f"config stale_policy={cfg.stale_policy!r}: use wait or drop")
    if not cfg.sync_bucket_mb > 0:
        raise ValueError(f"config sync_bucket_mb={cfg.sync_bucket_mb!r}: must be > 0")
    try:
        cfg.staleness()
    except ValueError as err:
        raise ValueError(f"config: {err}") from None


class PipelinedSteps:
    """What every step function over a RolloutPipeline shares (call it with (step, prompts), as
    Trainer does; then `close()`): the pipeline, started on the first step (after a resume: at the
    resumed version); prompts in data order (the pipeline takes the prompts the Trainer gives each
    step, and draws the next ones from the Trainer's source when it starts a rollout before they
    were given); a relaunched rollout daemon resynced before its calls are retried. A subclass
    gives `_generate(step, prompts)` (one rollout) and `__call__`, built on `_take` and `_publish`."""

    def __init__(self, cfg: PipelineConfig, roles: dict[str, Any], trainer: Trainer) -> None:
        self.roles, self.trainer = roles, trainer
        self._given: deque[BatchHandle] = deque()
        sync = WeightSync(roles["actor"], roles["rollout"], bucket_mb=cfg.sync_bucket_mb)
        self.pipeline = RolloutPipeline(sync, cfg.staleness(), self._generate, self._next_prompts, steps=cfg.steps)
        self._prompts_per_step = cfg.prompts_per_step
        self._started = False
        recovery = getattr(trainer.ctl, "recovery", None)
        if recovery is not None:
            recovery.on_restart("rollout", self._rollout_restarted)

    async def _generate(self, step: int, prompts: BatchHandle) -> BatchHandle:
        raise NotImplementedError

    def _next_prompts(self) -> BatchHandle:
        return self._given.popleft() if self._given else self.trainer.more_prompts(self._prompts_per_step)

    async def _rollout_restarted(self, replaced: list[str]) -> None:
        """Recovery's hook (hfrt.control.recovery.Recovery.on_restart): a relaunched rollout daemon gets
        the actor's current weights before its failed calls are retried."""
        await self.pipeline.resync()

    async def _take(self, t: StageTimer, step: int, prompts: BatchHandle) -> tuple[BatchHandle, dict[str, Any]]:
        """The rollout this step trains on (stage `generate`: waiting for it) and its async/* metrics."""
        self._given.append(prompts)
        if not self._started:
            self._started = True
            await self.pipeline.start(step)
        return await t.one("generate", self.pipeline.take(step))

    async def _publish(self, t: StageTimer, step: int) -> dict[str, Any]:
        """Publish version step + 1 and start the next rollouts (stage `sync`; the publish itself
        goes on in a task); sync/* of the loads finished so far."""
        start = time.perf_counter()
        info = await t.one("sync", self.pipeline.trained(step + 1))
        info["timing/sync_s"] = time.perf_counter() - start
        return info

    async def close(self, *, abort: bool = False) -> None:
        await self.pipeline.close(abort=abort)


class AsyncGRPO(PipelinedSteps):
    """The step function of `grpo_async`: PipelinedSteps whose rollout is the rollout role's
    `generate` (or partial_rollout), with reference and reward started early on request."""

    def __init__(self, cfg: GRPOAsyncConfig, roles: dict[str, Any], trainer: Trainer) -> None:
        self.cfg = cfg
        self._stage2: dict[int, list[tuple[BatchHandle, Any, Any]]] = {}  # step → (rollout, ref, scores) started early
        super().__init__(cfg, roles, trainer)

    def _generate(self, step: int, prompts: BatchHandle) -> Any:
        cfg = self.cfg
        sampling = {"n": cfg.n, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                    "seed": sampling_seed(cfg, step), "timeout_s": CALL_TIMEOUT_S}
        if cfg.partial_rollout_tokens:
            call = partial_rollout(self.roles["rollout"], prompts, segment_tokens=cfg.partial_rollout_tokens, **sampling)
        else:
            call = self.roles["rollout"].generate(prompts, **sampling)
        return self._then_stage2(step, call)

    async def _then_stage2(self, step: int, call: Awaitable[BatchHandle]) -> BatchHandle:
        """The rollout; with early_stage2, its reference log-probs and reward scores are started as
        soon as it is there (start early: they run while the actor still trains an earlier step)
        and `__call__` uses them if the step trains on this very rollout (not on a part of it)."""
        rollout = await call
        if not self.cfg.early_stage2:
            return rollout
        kw = {"timeout_s": CALL_TIMEOUT_S}
        ref = asyncio.ensure_future(self.roles["reference"].compute_log_prob(rollout, **kw))
        scores = asyncio.ensure_future(self.roles["reward"].score(rollout, **kw))
        for future in (ref, scores):  # an unused pair's error is not "never retrieved"
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._stage2.setdefault(step, []).append((rollout, ref, scores))
        return rollout

    async def __call__(self, step: int, prompts: BatchHandle) -> dict[str, Any]:
        t = StageTimer()
        rollout, info = await self._take(t, step, prompts)
        early = next(((ref, scores) for batch, ref, scores in self._stage2.pop(step, []) if batch is rollout), None)
        record = await train_on(self.cfg, t, rollout, early=early, **{k: self.roles[k] for k in ("actor", "reference", "reward")})
        info |= await self._publish(t, step)
        trained_s = max(t.step_s() - info["async/train_wait_s"], 1e-9)
        info["perf/train_tokens_per_s"] = float(record.get("response_tokens", 0.0)) / trained_s
        return record | info | {"timing/step_s": t.step_s()}


async def train_on(
    cfg: GRPOFlowConfig, t: StageTimer, rollout: BatchHandle, *, actor: Any, reference: Any, reward: Any,
    early: tuple[Awaitable[BatchHandle], Awaitable[BatchHandle]] | None = None,
) -> dict[str, Any]:
    """grpo's stages after generation, on a rollout made elsewhere; the step's metrics. `early`:
    the rollout's (reference log-probs, reward scores) calls, already started."""
    kw = {"timeout_s": CALL_TIMEOUT_S}
    ref_call, score_call = early or (reference.compute_log_prob(rollout, **kw), reward.score(rollout, **kw))
    ref, scores = await t.together("stage2", ref_log_prob=ref_call, reward=score_call)
    # as in grpo: one optimizer step takes the actor's current log-probs as the old ones (the
    # proximal policy); the rollout engine's own log-probs enter through tis_cap
    old = [] if cfg.on_policy(len(rollout)) else [await t.one("old_log_prob", actor.compute_log_prob(rollout, **kw))]
    adv = await t.one("advantages", actor.compute_advantages(
        rollout, scores, *old, ref, estimator="grpo", norm_adv_by_std=cfg.norm_adv_by_std, **kw))
    actor_ranks = await t.one("update", actor.update(rollout, *old, ref, adv, **actor_loss_options(cfg), **kw))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))
