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
import itertools
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Unpack

from hfrt.flows.batches import non_tensor
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Rollout, Sampling

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
    ahead: rollouts started beyond the one being trained (-1: max_staleness; "wait" caps it there).
    min_keep: under "drop", the share of a step's prompt groups that must survive the bound; with
    fewer, the dropped prompts are generated again (a top-up). Too-old groups are dropped one by
    one (a group is one prompt's samples, so GRPO groups stay whole); "wait" keeps every group."""

    max_staleness: int = 1
    on_stale: str = "wait"
    ahead: int = -1
    min_keep: float = 0.5

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r}: must not be negative")
        if self.on_stale not in STALE_POLICIES:
            raise ValueError(f"stale policy {self.on_stale!r}: use wait or drop")
        if self.ahead < -1:
            raise ValueError(f"rollout_ahead={self.ahead!r}: must be -1 (= max_staleness) or at least 0")
        if not 0.0 <= self.min_keep <= 1.0:
            raise ValueError(f"stale_min_keep={self.min_keep!r}: must be a share between 0 and 1")

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

    def __init__(self, actor: Actor, rollout: Rollout, *, bucket_mb: float = 64.0) -> None:
        self.actor, self.rollout, self.bucket_mb = actor, rollout, bucket_mb
        self.sent = -1  # the newest version whose load has been sent
        self._loads: collections.deque[tuple[int, float, dict[str, Any], asyncio.Future[Any]]] = collections.deque()
        self._ended: dict[int, float] = {}

    async def publish(self, version: int) -> asyncio.Future[Any]:
        """Publish `version` on the actor and send its load to the rollout role; the load's future."""
        start = time.perf_counter()
        try:
            per_rank = await self.actor.publish_weights(version, bucket_mb=self.bucket_mb)
        except Exception as exc:
            raise RolloutError(f"weight sync to version {version}: the actor could not publish: {exc}") from exc
        record = per_rank[0]  # rank 0 holds the buckets; the others only took part in gathering
        load = asyncio.ensure_future(self.rollout.load_weights(record))
        load.add_done_callback(lambda _: self._ended.setdefault(version, time.perf_counter()))
        # the record holds the buckets' handles: kept until the load is done, or the actor frees them
        self._loads.append((version, start, record, load))
        self.sent = version
        return load

    def finished(self) -> dict[str, float]:
        """Metrics of the loads done since the last call, raising a failed load's error: sync/version
        (the newest), sync/versions (how many loads these figures cover: a publish overlaps the next
        step, so two can finish between records), and per version the means of sync/time_s,
        publish_s, load_s, bytes and buckets, plus sync/bytes_total."""
        done: list[dict[str, float]] = []
        while self._loads and self._loads[0][3].done():
            version, start, record, load = self._loads.popleft()
            try:
                ranks = load.result()
            except Exception as exc:
                raise RolloutError(f"weight sync to version {version} failed: {exc}") from exc
            done.append({
                "sync/version": float(version), "sync/time_s": self._ended.pop(version, time.perf_counter()) - start,
                "sync/publish_s": float(record["timing/publish_s"]), "sync/load_s": max(float(r["timing/load_s"]) for r in ranks),
                "sync/bytes": float(ranks[0]["bytes"]), "sync/buckets": float(ranks[0]["buckets"]),
            })
        if not done:
            return {}
        out = {key: sum(d[key] for d in done) / len(done) for key in done[0]}
        out |= {"sync/version": done[-1]["sync/version"], "sync/versions": float(len(done)),
                "sync/bytes_total": sum(d["sync/bytes"] for d in done)}
        return out

    async def drain(self) -> dict[str, float]:
        """Wait for every load sent; their metrics (as `finished`)."""
        if self._loads:
            await asyncio.wait([entry[3] for entry in self._loads])
        return self.finished()

    def cancel(self) -> None:
        for *_, load in self._loads:
            load.cancel()
        self._loads.clear()


async def partial_rollout(rollout: Rollout, prompts: BatchHandle, *, segment_tokens: int, **sampling: Unpack[Sampling]) -> BatchHandle:
    """One rollout generated in segments of at most `segment_tokens` new tokens
    (`rollout.generate_partial`, roles/partial_rollout.py): each segment call is sent when the
    previous one returned, so a weight load sent meanwhile reaches the rollout daemons first and
    the unfinished rows go on with the new weights. Returns the finished rollout (per-token
    `token_versions`, per-row `weight_version` = the oldest token's version)."""
    key = uuid.uuid4().hex
    for segment in itertools.count():
        # `segment` lets a replaced rollout daemon see that it lost this rollout's rows, and make
        # the whole rollout again in one call (so a recovery retry of this call is a full rollout)
        out = await rollout.generate_partial(prompts, key=key, segment_tokens=segment_tokens, segment=segment, **sampling)
        if not out.meta.get("unfinished"):
            return out
    raise AssertionError("unreachable")


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
        self._publishing: asyncio.Future[None] | None = None  # trained()'s publish-then-fill

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
        """The rollout for `step` (waiting for it if needed), with the staleness metrics.

        Prompt groups (rows sharing a `uid`; a batch without uids is one group) whose oldest
        token is more than max_staleness versions old are dropped; when fewer than the policy's
        share survive ("wait": all of them), the dropped prompts are generated again with the
        newest weights sent and appended (their groups are checked again)."""
        if (not self._flight or self._flight[0].step != step) and self._publishing is not None:
            await self._published()  # its rollout starts once the newest version is published
        if not self._flight or self._flight[0].step != step:
            raise RolloutError(f"take({step}): the next rollout in flight is for step {self._flight[0].step if self._flight else None}")
        waited = time.perf_counter()
        entry = self._flight.popleft()
        batch = await self._result(step, entry.future)
        prompts = self._prompts.pop(step, None)
        batch, versions, drops = await self._drop_stale(step, batch, prompts)
        now = time.perf_counter()
        info = staleness_metrics(step, versions, self.policy.max_staleness) | self.sync.finished()
        busy = drops.pop("busy") + info.get("sync/load_s", 0.0) * info.get("sync/versions", 0.0)
        tokens = float(batch.meta.get("response_tokens", 0.0))
        generate_s = float(batch.meta.get("timing/generate_s", 0.0))
        info |= drops | {
            "async/train_wait_s": now - waited,
            "async/rollout_busy_s": busy, "async/rollout_idle_s": max(0.0, (now - self._mark) - busy),
            "perf/rollout_tokens_per_s": tokens / generate_s if generate_s > 0 else 0.0,
        }
        if "segments" in batch.meta:  # a partial rollout: segments, rows whose tokens span versions
            newest = non_tensor(batch, "weight_version_max") if _has_column(batch, "weight_version_max") else versions
            info["async/partial_segments"] = float(batch.meta["segments"])
            info["async/rows_spanning_versions"] = sum(hi > lo for lo, hi in zip(versions, newest, strict=True)) / len(versions)
        self._mark = now
        return batch, info

    async def _result(self, step: int, future: Awaitable[BatchHandle]) -> BatchHandle:
        try:
            return await future
        except Exception as exc:
            raise RolloutError(f"the rollout for step {step} failed: {exc}") from exc

    async def _drop_stale(
        self, step: int, batch: BatchHandle, prompts: BatchHandle | None
    ) -> tuple[BatchHandle, list[int], dict[str, float]]:
        """(the rows trained on, their versions, drop metrics and the rollout's busy time)."""
        bound, pending = self.policy.max_staleness, None
        kept: list[BatchHandle] = []
        versions: list[int] = []
        counts = {"busy": 0.0, "async/dropped_rows": 0.0, "async/dropped_groups": 0.0, "async/dropped_batches": 0.0}
        total = need = 0
        while True:
            counts["busy"] += float(batch.meta.get("timing/generate_s", 0.0))
            rows = [int(v) for v in non_tensor(batch, "weight_version")]
            if not rows:
                raise RolloutError(f"the rollout for step {step} has no weight_version column (is the rollout role a `rollout` daemon?)")
            groups = row_groups(batch)
            if pending is not None and len(groups) != len(pending):
                raise RolloutError(f"step {step}: generated {len(pending)} prompts again, got {len(groups)} groups back")
            if pending is None:  # the first rollout of the step: every prompt group it holds
                pending, total = list(range(len(groups))), len(groups)
                need = total if self.policy.on_stale == "wait" else max(1, math.ceil(self.policy.min_keep * total))
            stale = [g for g, (lo, hi) in enumerate(groups) if step - min(rows[lo:hi]) > bound]
            if not stale and not kept:
                return batch, rows, counts  # the usual case: the whole rollout, as it came
            fresh = [g for g in range(len(groups)) if g not in stale]
            for lo, hi in runs([groups[g] for g in fresh]):
                kept.append(batch.slice(lo, hi))
                versions += rows[lo:hi]
            counts["async/dropped_rows"] += float(sum(groups[g][1] - groups[g][0] for g in stale))
            counts["async/dropped_groups"] += float(len(stale))
            pending = [pending[g] for g in stale]
            if total - len(pending) >= need:
                break
            batch = await self._top_up(step, prompts, pending, min(rows), counts)
        if not kept:
            raise RolloutError(f"step {step}: every sample was too old (internal: nothing kept)")
        return (kept[0] if len(kept) == 1 else BatchHandle.concat(kept)), versions, counts

    async def _top_up(
        self, step: int, prompts: BatchHandle | None, pending: list[int], oldest: int, counts: dict[str, float]
    ) -> BatchHandle:
        """Generate the prompts of dropped groups again, with the newest weights sent."""
        await self._published()  # the version trained last may still be on its way
        if step - self.sync.sent > self.policy.max_staleness:
            raise RolloutError(f"step {step}: its samples are too old and no newer weights were sent (newest: {self.sync.sent})")
        counts["async/dropped_batches"] += 1.0
        again = counts["async/dropped_batches"]
        if again == 2:  # too old although generated after the newest version was sent: a restarted daemon?
            await self.sync.publish(self.version)  # push the current weights once more
        elif again > 2:
            raise RolloutError(
                f"step {step}: the rollout role keeps generating with version {oldest} although version "
                f"{self.sync.sent} was sent (a rollout daemon restarted without its weights?)")
        if prompts is None:
            raise RolloutError(f"step {step}: samples to generate again but its prompts are gone")
        subset = prompts if len(pending) == len(prompts) else BatchHandle.concat([prompts.slice(i, i + 1) for i in pending])
        return await self._result(step, asyncio.ensure_future(self.generate(step, subset)))

    async def trained(self, version: int) -> dict[str, float]:
        """The actor now holds `version`: publish it to the rollout role and start the rollouts
        that the new version allows, in a task (the next step's stages start meanwhile; a take
        that needs a rollout this starts waits for it). Returns sync/* of loads finished so far."""
        self.version = version
        previous = self._publishing

        async def publish_then_fill() -> None:
            if previous is not None:
                await previous
            if version < self.steps:  # version `steps` would train nothing
                await self.sync.publish(version)
            self._fill()

        self._publishing = asyncio.ensure_future(publish_then_fill())
        return self.sync.finished()

    async def _published(self) -> None:
        """Wait for the publishing started by `trained` (raising its error)."""
        if self._publishing is not None:
            task, self._publishing = self._publishing, None
            await task

    async def resync(self) -> None:
        """Push the current version again and wait until that load is done (a replaced rollout
        daemon starts with its initial weights; calls retried after this generate with these).
        Loads sent before, to the daemon that died, are not waited for: they are retried after."""
        load = await self.sync.publish(self.version)
        await asyncio.shield(load)

    async def close(self, *, abort: bool = False) -> None:
        """Stop rollouts still in flight and wait for the loads already sent (raising a failed
        load's error); with abort=True (the flow is failing already) drop them without raising,
        so the first error is the one reported."""
        try:
            await self._published()
        except Exception:
            if not abort:
                self.sync.cancel()
                raise
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



def _has_column(batch: BatchHandle, name: str) -> bool:
    return bool(batch.shards) and all(name in shard.non_tensor for shard in batch.shards)


def row_groups(batch: BatchHandle) -> list[tuple[int, int]]:
    """[start, stop) of each prompt group: adjacent rows with one `uid` (samples of a prompt are
    adjacent in a rollout); a batch without uids is one group."""
    if not _has_column(batch, "uid"):
        return [(0, len(batch))]
    uids = non_tensor(batch, "uid")
    bounds = [0] + [i for i in range(1, len(uids)) if uids[i] != uids[i - 1]] + [len(uids)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def runs(groups: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent [start, stop) ranges merged (fewer slices of the batch)."""
    out: list[tuple[int, int]] = []
    for lo, hi in groups:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
