"""Step functions over a RolloutPipeline (hfrt.flows.pipeline): PipelinedSteps, what every such step
function shares (the pipeline started on the first step, prompts in data order, a relaunched
rollout daemon resynced); RolloutRoleSteps, the one whose rollout is the rollout role's sampling
(grpo_async, distill_async: they differ only in what they score and train); PipelineSettings,
the config fields of such a flow; `run_and_close` to run one under the Trainer, and the check of
a flow's pipeline settings.

No torch: futures and handles. It knows the rollout and actor roles by name and the settings a
pipeline reads; what a rollout is and what a step trains is the subclass's business.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hfrt.flows.pipeline import STALE_POLICIES, RolloutPipeline, StalenessPolicy, WeightSync, partial_rollout
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import Trainer, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Rollout, Sampling


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
        recovery = trainer.ctl.recovery
        if recovery is not None:
            recovery.on_restart("rollout", self._rollout_restarted)

    def _generate(self, step: int, prompts: BatchHandle) -> Awaitable[BatchHandle]:
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
        return await t.one(Stage.GENERATE, self.pipeline.take(step))

    async def _publish(self, t: StageTimer, step: int) -> dict[str, Any]:
        """Publish version step + 1 and start the next rollouts (stage `sync`; the publish itself
        goes on in a task); sync/* of the loads finished so far."""
        start = time.perf_counter()
        info = await t.one(Stage.SYNC, self.pipeline.trained(step + 1))
        info["timing/sync_s"] = time.perf_counter() - start
        return info

    async def close(self, *, abort: bool = False) -> None:
        await self.pipeline.close(abort=abort)


@dataclass(frozen=True)
class PipelineSettings:
    """The settings a flow over the rollout role adds to its config (GRPOAsyncConfig,
    DistillAsyncConfig: `class C(FlowCfg, PipelineSettings)`); its __post_init__ calls
    `self.check_pipeline()`. tis_cap > 0 (FlowConfig's) weights each token's loss by
    min(π_old / π_rollout, tis_cap) with the rollout engine's log-probs."""

    #: policy versions a sample may lag behind the actor (0: synchronous)
    max_staleness: int = 1
    #: "wait": rollouts never run further ahead than max_staleness; "drop": rollout_ahead rollouts
    #: stay in flight and samples found too old are generated again
    stale_policy: str = "wait"
    #: rollouts in flight under "drop" (-1: max_staleness)
    rollout_ahead: int = -1
    #: under "drop", too-old prompt groups are dropped one by one; when fewer than this share of a
    #: step's groups survive, the dropped prompts are generated again
    stale_min_keep: float = 0.5
    #: the weight sync's bucket size, in MiB
    sync_bucket_mb: float = 64.0
    #: K > 0: rollouts are generated K new tokens at a time, and a weight sync in between resumes
    #: the unfinished rows with the new weights (0: off)
    partial_rollout_tokens: int = 0
    #: start a rollout's scoring calls (reference or teacher log-probs, reward scores) as soon as it
    #: is generated (while the actor still trains the step before): worth it when those daemons have
    #: devices of their own (e.g. on the generation pool); beside the actor they only take its time
    early_stage2: bool = False

    def staleness(self) -> StalenessPolicy:
        return StalenessPolicy(self.max_staleness, self.stale_policy, self.rollout_ahead, self.stale_min_keep)

    def check_pipeline(self) -> None:
        """ValueError naming the pipeline setting that cannot work."""
        check_pipeline_settings(self)  # type: ignore[arg-type]  # a flow config: steps, prompts_per_step too
        if self.partial_rollout_tokens < 0:
            raise ValueError(f"config partial_rollout_tokens={self.partial_rollout_tokens!r}: must be >= 0 (0: off)")


class RolloutConfig(PipelineConfig, Protocol):
    """What RolloutRoleSteps reads of a flow's settings besides PipelineConfig's."""

    @property
    def n(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def partial_rollout_tokens(self) -> int: ...
    @property
    def early_stage2(self) -> bool: ...


#: a rollout's scoring calls, started (a reference's or teacher's log-probs, the reward's scores)
Scored = tuple[Awaitable[BatchHandle], Awaitable[BatchHandle]]
#: start the scoring calls of a rollout
ScoreFn = Callable[[BatchHandle], Scored]
#: train on a rollout (the scoring calls already started, or None): the step's metrics
TrainFn = Callable[[StageTimer, BatchHandle, Scored | None], Awaitable[dict[str, Any]]]


class RolloutRoleSteps(PipelinedSteps):
    """PipelinedSteps whose rollout is the rollout role's `generate` (or `partial_rollout`) with the
    flow's sampling (n, max_new_tokens, temperature, the step's seed), trained by `train`; with
    early_stage2, `score(rollout)` starts as soon as a rollout is there and the step trains with
    those calls if it trains on that very rollout (not a part of it). grpo_async passes (reference
    ∥ reward) and GRPO's stages; distill_async (teacher ∥ reward) and distillation's."""

    def __init__(self, cfg: RolloutConfig, roles: dict[str, Any], trainer: Trainer, *, score: ScoreFn, train: TrainFn) -> None:
        self.cfg, self.score, self.train = cfg, score, train
        self.rollout: Rollout = roles["rollout"]
        self._stage2: dict[int, list[tuple[BatchHandle, asyncio.Future[BatchHandle], asyncio.Future[BatchHandle]]]] = {}
        super().__init__(cfg, roles, trainer)

    def _generate(self, step: int, prompts: BatchHandle) -> Awaitable[BatchHandle]:
        cfg = self.cfg
        sampling = Sampling(n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=sampling_seed(cfg, step))  # type: ignore[arg-type]
        call: Awaitable[BatchHandle]
        if cfg.partial_rollout_tokens:
            call = partial_rollout(self.rollout, prompts, segment_tokens=cfg.partial_rollout_tokens, **sampling)
        else:
            call = self.rollout.generate(prompts, **sampling)
        return self._then_stage2(step, call)

    async def _then_stage2(self, step: int, call: Awaitable[BatchHandle]) -> BatchHandle:
        """The rollout; with early_stage2 its scoring calls are started as soon as it is there
        (start early: they run while the actor still trains an earlier step)."""
        rollout = await call
        if not self.cfg.early_stage2:
            return rollout
        first, second = (asyncio.ensure_future(c) for c in self.score(rollout))
        for future in (first, second):  # an unused pair's error is not "never retrieved"
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._stage2.setdefault(step, []).append((rollout, first, second))
        return rollout

    async def __call__(self, step: int, prompts: BatchHandle) -> dict[str, Any]:
        t = StageTimer()
        rollout, info = await self._take(t, step, prompts)
        early = next(((a, b) for batch, a, b in self._stage2.pop(step, []) if batch is rollout), None)
        record = await self.train(t, rollout, early)
        info |= await self._publish(t, step)
        trained_s = max(t.step_s() - info["async/train_wait_s"], 1e-9)
        info["perf/train_tokens_per_s"] = float(record.get("response_tokens", 0.0)) / trained_s
        return record | info | {"timing/step_s": t.step_s()}
