"""Building blocks for asynchronous RL flows: rollouts generated ahead of training on a separate
`rollout` role, the actor's weights pushed to it as numbered versions after every update, and a
staleness bound in policy versions.

Overlap is start early, await late, inside `RolloutPipeline` (see its docstring for the loop).
Ordering comes from the daemons: calls to one rollout daemon run in arrival order, so a rollout
sent after a version's `load_weights` generates with that version (or a later one). Staleness is
read from what the daemons report (`weight_version` on every sample), never assumed.

No torch: futures, handles and numbers. It knows the actor's `publish_weights` and the rollout
role's `load_weights` / `generate`; nothing of what a step computes with the samples.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hfrt.protocols import BatchHandle

from .common import CALL_TIMEOUT_S, non_tensor

#: start one rollout for a step from its prompts: `rollout.generate(prompts, ...)` with the step's seed
GenerateFn = Callable[[int, BatchHandle], Awaitable[BatchHandle]]
#: the prompts of the next rollout to start, in data order
PromptsFn = Callable[[], BatchHandle]
STALE_POLICIES = ("wait", "drop")


class RolloutError(RuntimeError):
    """A rollout or a weight sync failed; the message names the step or version and the cause
    (a dead rollout daemon is named by the DaemonGone it raised)."""


@dataclass(frozen=True)
class StalenessPolicy:
    """max_staleness: how many policy versions a sample may lag the weights it trains (0:
    synchronous). on_stale: "wait" starts a rollout only when the synced weights are recent enough,
    so no sample is ever too stale; "drop" keeps `ahead` rollouts in flight whatever their version
    and throws away (and generates again) those that are too old when their turn comes.
    ahead: rollouts started beyond the one being trained (-1: max_staleness; "wait" caps it there)."""

    max_staleness: int = 1
    on_stale: str = "wait"
    ahead: int = -1

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r}: must not be negative")
        if self.on_stale not in STALE_POLICIES:
            raise ValueError(f"stale policy {self.on_stale!r}: use wait or drop")
        if self.ahead < -1:
            raise ValueError(f"rollout_ahead={self.ahead!r}: must be -1 (= max_staleness) or at least 0")

    @property
    def depth(self) -> int:
        """Rollouts started beyond the one being trained."""
        ahead = self.max_staleness if self.ahead < 0 else self.ahead
        return min(ahead, self.max_staleness) if self.on_stale == "wait" else ahead


class WeightSync:
    """Pushes the actor's weights to the rollout role as numbered versions; bytes move by handle.

    `publish(v)` waits for the actor to pack version v (so a rollout started afterwards follows its
    load on the rollout daemons) and sends the load without waiting; `finished()` collects the
    loads that completed: sync/version, time_s (publish start to load end), bytes, buckets."""

    def __init__(self, actor: Any, rollout: Any, *, bucket_mb: float = 64.0, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.actor, self.rollout, self.bucket_mb, self.timeout_s = actor, rollout, bucket_mb, timeout_s
        self.sent = -1  # the newest version whose load has been sent
        self._loads: collections.deque[tuple[int, float, dict[str, Any], asyncio.Future[Any]]] = collections.deque()
        self._ended: dict[int, float] = {}

    async def publish(self, version: int) -> None:
        start = time.perf_counter()
        try:
            per_rank = await self.actor.publish_weights(version, bucket_mb=self.bucket_mb, timeout_s=self.timeout_s)
        except Exception as exc:
            raise RolloutError(f"weight sync to version {version}: the actor could not publish: {exc}") from exc
        record = per_rank[0]  # rank 0 holds the buckets; the others only took part in gathering
        load = asyncio.ensure_future(self.rollout.load_weights(record, timeout_s=self.timeout_s))
        load.add_done_callback(lambda _: self._ended.setdefault(version, time.perf_counter()))
        # the record holds the buckets' handles: kept until the load is done, or the actor frees them
        self._loads.append((version, start, record, load))
        self.sent = version

    def finished(self) -> dict[str, float]:
        """Metrics of the loads done so far (the newest one's), raising a failed load's error."""
        out: dict[str, float] = {}
        while self._loads and self._loads[0][3].done():
            version, start, record, load = self._loads.popleft()
            try:
                ranks = load.result()
            except Exception as exc:
                raise RolloutError(f"weight sync to version {version} failed: {exc}") from exc
            out = {
                "sync/version": float(version), "sync/time_s": self._ended.pop(version, time.perf_counter()) - start,
                "sync/publish_s": float(record["timing/publish_s"]), "sync/load_s": max(float(r["timing/load_s"]) for r in ranks),
                "sync/bytes": float(ranks[0]["bytes"]), "sync/buckets": float(ranks[0]["buckets"]),
            }
        return out

    async def drain(self) -> dict[str, float]:
        """Wait for every load sent; their metrics (the newest)."""
        if self._loads:
            await asyncio.wait([entry[3] for entry in self._loads])
        return self.finished()

    def cancel(self) -> None:
        for *_, load in self._loads:
            load.cancel()
        self._loads.clear()


@dataclass
class _InFlight:
    step: int
    future: asyncio.Future[BatchHandle]
    started: float


class RolloutPipeline:
    """Rollouts for future steps generated on the rollout role while the actor trains.

    A flow's loop (hfrt/flows/grpo_async.py is the full one)::

        pipeline = RolloutPipeline(sync, policy, generate, next_prompts, steps=cfg.steps)
        await pipeline.start(first_step)               # version first_step to the rollout; rollouts start
        for step in range(first_step, cfg.steps):
            batch, info = await pipeline.take(step)     # await late: started up to `depth` steps ago
            ...                                         # train on batch: the actor's weights become step + 1
            info |= await pipeline.trained(step + 1)    # publish that version, start early the next rollouts
        await pipeline.close()                          # close(abort=True) when the loop failed

    `take` reports async/staleness_* (policy versions each sample lags the weights it trains,
    from the samples' `weight_version`), async/train_wait_s (training idle: waiting for samples),
    async/rollout_busy_s and async/rollout_idle_s (the rollout side over the same interval),
    async/dropped_batches, perf/rollout_tokens_per_s; sync/* come with the loads that finished.
    """

    def __init__(
        self, sync: WeightSync, policy: StalenessPolicy, generate: GenerateFn, next_prompts: PromptsFn, *, steps: int
    ) -> None:
        self.sync, self.policy, self.generate, self.next_prompts, self.steps = sync, policy, generate, next_prompts, steps
        self.version = 0  # the actor's current policy version (updates applied)
        self._flight: collections.deque[_InFlight] = collections.deque()
        self._prompts: dict[int, BatchHandle] = {}
        self._next = 0  # the next step whose rollout has not been started
        self._mark = time.perf_counter()  # end of the previous take's interval

    async def start(self, version: int) -> None:
        """Push version `version` (the policy as trained so far) and start the first rollouts."""
        self.version, self._next, self._mark = version, version, time.perf_counter()
        await self.sync.publish(version)
        self._fill()

    def _fill(self) -> None:
        """Start every rollout the policy allows now (in step order, after the loads already sent)."""
        while self._next < self.steps and self._next <= self.version + self.policy.depth:
            if self.policy.on_stale == "wait" and self._next - self.sync.sent > self.policy.max_staleness:
                break
            self._launch(self._next)
            self._next += 1

    def _launch(self, step: int) -> None:
        prompts = self._prompts.setdefault(step, self.next_prompts())
        self._flight.append(_InFlight(step, asyncio.ensure_future(self.generate(step, prompts)), time.perf_counter()))

    async def take(self, step: int) -> tuple[BatchHandle, dict[str, float]]:
        """The rollout for `step` (waiting for it if needed), with the staleness metrics."""
        if not self._flight or self._flight[0].step != step:
            raise RolloutError(f"take({step}): the next rollout in flight is for step {self._flight[0].step if self._flight else None}")
        waited, dropped, busy = time.perf_counter(), 0, 0.0
        while True:
            entry = self._flight[0]
            try:
                batch = await entry.future
            except Exception as exc:
                raise RolloutError(f"the rollout for step {step} failed: {exc}") from exc
            self._flight.popleft()
            busy += float(batch.meta.get("timing/generate_s", 0.0))
            versions = [int(v) for v in non_tensor(batch, "weight_version")]
            if not versions:
                raise RolloutError(f"the rollout for step {step} has no weight_version column (is the rollout role a `rollout` daemon?)")
            if step - min(versions) <= self.policy.max_staleness:
                break
            dropped += 1  # too old: generate this step again with the newest weights sent
            if step - self.sync.sent > self.policy.max_staleness:
                raise RolloutError(f"step {step}: its samples are too old and no newer weights were sent (newest: {self.sync.sent})")
            if dropped == 2:  # too old although generated after the newest version was sent: a restarted daemon?
                await self.sync.publish(self.version)  # push the current weights once more
            elif dropped > 2:
                raise RolloutError(
                    f"step {step}: the rollout role keeps generating with version {min(versions)} although version "
                    f"{self.sync.sent} was sent (a rollout daemon restarted without its weights?)")
            self._flight.appendleft(_InFlight(step, asyncio.ensure_future(self.generate(step, self._prompts[step])), time.perf_counter()))
        self._prompts.pop(step, None)
        now = time.perf_counter()
        info = staleness_metrics(step, versions, self.policy.max_staleness) | self.sync.finished()
        busy += info.get("sync/load_s", 0.0)
        tokens = float(batch.meta.get("response_tokens", 0.0))
        generate_s = float(batch.meta.get("timing/generate_s", 0.0))
        info |= {
            "async/train_wait_s": now - waited, "async/dropped_batches": float(dropped),
            "async/rollout_busy_s": busy, "async/rollout_idle_s": max(0.0, (now - self._mark) - busy),
            "perf/rollout_tokens_per_s": tokens / generate_s if generate_s > 0 else 0.0,
        }
        self._mark = now
        return batch, info

    async def trained(self, version: int) -> dict[str, float]:
        """The actor now holds `version`: publish it to the rollout role and start the rollouts
        that the new version allows. Returns sync/* of loads finished meanwhile."""
        self.version = version
        if version < self.steps:  # version `steps` would train nothing
            await self.sync.publish(version)
        self._fill()
        return self.sync.finished()

    async def close(self, *, abort: bool = False) -> None:
        """Stop rollouts still in flight and wait for the loads already sent (raising a failed
        load's error); with abort=True (the flow is failing already) drop them without raising,
        so the first error is the one reported."""
        for entry in self._flight:
            entry.future.cancel()
        for entry in self._flight:
            with contextlib.suppress(BaseException):
                await entry.future
        self._flight.clear()
        try:
            if not abort:
                await self.sync.drain()
        finally:
            self.sync.cancel()


def staleness_metrics(step: int, versions: list[int], bound: int) -> dict[str, float]:
    """Staleness (step − weight_version) of one step's samples: mean, max, and the histogram as
    the share of samples at each lag 0..bound (`async/staleness_hist/<lag>`)."""
    lags = [step - v for v in versions]
    counts = collections.Counter(lags)
    out = {f"async/staleness_hist/{lag}": counts.get(lag, 0) / len(lags) for lag in range(bound + 1)}
    return out | {
        "async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags)),
        "async/weight_version_min": float(min(versions)),
    }

