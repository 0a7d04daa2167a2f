"""Step functions over a RolloutPipeline (hfrt.flows.pipeline): PipelinedSteps, what every such step
function shares (the pipeline started on the first step, prompts in data order, a relaunched
rollout daemon resynced), `run_and_close` to run one under the Trainer, and the check of a flow's
pipeline settings.

No torch: futures and handles. It knows the rollout and actor roles by name and the settings a
pipeline reads; what a rollout is and what a step trains is the subclass's business.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable
from typing import Any, Protocol

from hfrt.flows.pipeline import STALE_POLICIES, RolloutPipeline, StalenessPolicy, WeightSync
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import Trainer
from hfrt.protocols import BatchHandle


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
