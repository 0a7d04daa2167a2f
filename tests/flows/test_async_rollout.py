"""RolloutPipeline and WeightSync logic against fake role groups (pure asyncio, no processes): the
arrival-order versioning, the staleness bound under "wait" and "drop" (per prompt group, with a
top-up), partial rollouts' segment loop, metrics, errors named."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hfrt.flows.batches import non_tensor
from hfrt.flows.pipeline import (
    RolloutError,
    RolloutPipeline,
    StalenessPolicy,
    WeightSync,
    partial_rollout,
    row_groups,
    runs,
    staleness_metrics,
)
from hfrt.flows.recipes.grpo_async import GRPOAsyncConfig
from hfrt.protocols import BatchHandle


class FakeRollout:
    """One rollout daemon: calls run in arrival order, generate reports the version it holds."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.version = -1
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.log: list[tuple[str, int]] = []
        self.fail_at = fail_at
        self.task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            kind, arg, fut = await self.queue.get()
            await asyncio.sleep(0.001)
            if kind == "load":
                self.version = arg["version"]
                fut.set_result([{"timing/load_s": 0.001, "bytes": 10, "buckets": 1, "version": self.version}])
            elif arg == self.fail_at:
                fut.set_exception(RuntimeError("rollout:0 (pid 1) is gone (killed); generate did not finish"))
            else:
                fut.set_result(BatchHandle.inline({"weight_version": [self.version] * 2},
                                                  {"timing/generate_s": 0.001, "response_tokens": 4.0}))
            self.log.append((kind, arg["version"] if kind == "load" else arg))

    def _call(self, kind: str, arg: Any) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((kind, arg, fut))
        return fut

    def load_weights(self, record: dict[str, Any]) -> asyncio.Future[Any]:
        return self._call("load", record)

    def generate(self, step: int) -> asyncio.Future[Any]:
        return self._call("gen", step)


class FakeActor:
    async def publish_weights(self, version: int, bucket_mb: float) -> list[dict[str, Any]]:
        return [{"version": version, "buckets": [], "timing/publish_s": 0.0}]


async def run(policy: StalenessPolicy, steps: int, rollout: FakeRollout) -> list[dict[str, float]]:
    sync = WeightSync(FakeActor(), rollout)
    pipeline = RolloutPipeline(sync, policy, lambda step, prompts: rollout.generate(step),
                               lambda: BatchHandle.inline({"prompt": ["1+1="]}), steps=steps)
    infos = []
    try:
        await pipeline.start(0)
        for step in range(steps):
            _, info = await pipeline.take(step)
            infos.append(info | await pipeline.trained(step + 1))
    finally:
        await pipeline.close()
        rollout.task.cancel()
    return infos


@pytest.mark.parametrize("bound", [0, 1, 2])
async def test_wait_keeps_every_sample_within_the_bound(bound: int) -> None:
    rollout = FakeRollout()
    infos = await run(StalenessPolicy(bound, "wait"), 6, rollout)
    lags = [info["async/staleness_max"] for info in infos]
    assert lags == [min(step, bound) for step in range(6)]
    assert all(info["async/dropped_batches"] == 0 for info in infos)
    assert rollout.log[:2 + bound] == [("load", 0)] + [("gen", s) for s in range(bound + 1)]


async def test_drop_generates_too_old_samples_again() -> None:
    rollout = FakeRollout()
    infos = await run(StalenessPolicy(0, "drop", ahead=1), 4, rollout)
    assert [info["async/staleness_max"] for info in infos] == [0.0] * 4
    assert sum(info["async/dropped_batches"] for info in infos) == 3  # every rollout started a step early


async def test_a_failed_rollout_names_the_step_and_the_cause() -> None:
    with pytest.raises(RolloutError, match=r"the rollout for step 2 failed: rollout:0 \(pid 1\) is gone"):
        await run(StalenessPolicy(1, "wait"), 4, FakeRollout(fail_at=2))


def test_staleness_histogram_and_config_checks() -> None:
    m = staleness_metrics(5, [5, 4, 4, 3], bound=2)
    assert m["async/staleness_hist/0"] == 0.25 and m["async/staleness_hist/1"] == 0.5 and m["async/staleness_max"] == 2
    with pytest.raises(ValueError, match="stale_policy='later'"):
        GRPOAsyncConfig.read({"stale_policy": "later"})
    with pytest.raises(ValueError, match="max_staleness=-1"):
        GRPOAsyncConfig.read({"max_staleness": -1})
    assert StalenessPolicy(1, "wait", ahead=3).depth == 1 and StalenessPolicy(1, "drop", ahead=3).depth == 3


class FailingLoads(FakeRollout):
    def load_weights(self, record: dict[str, Any]) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(RuntimeError("rollout[0] (vm pid 1) is gone (killed); load_weights did not finish"))
        return fut


@pytest.mark.parametrize("abort", [False, True])
async def test_close_reports_a_failed_load_unless_aborting(abort: bool) -> None:
    rollout = FailingLoads()
    pipeline = RolloutPipeline(WeightSync(FakeActor(), rollout), StalenessPolicy(1), lambda step, prompts: rollout.generate(step),
                               lambda: BatchHandle.inline({"prompt": ["1+1="]}), steps=3)
    try:
        await pipeline.start(0)
        if abort:  # the flow already failed: its first error stays the one reported
            await pipeline.close(abort=True)
        else:
            with pytest.raises(RolloutError, match=r"weight sync to version 0 failed: rollout\[0\] \(vm pid 1\) is gone"):
                await pipeline.close()
    finally:
        rollout.task.cancel()


class Amnesiac(FakeRollout):
    """A rollout daemon that restarts (back to version -1) before generating step 2, and again
    after every load when `forever`."""

    def __init__(self, forever: bool) -> None:
        super().__init__()
        self.forever, self.restarted = forever, False

    def generate(self, step: int) -> asyncio.Future[Any]:
        if step == 2 and (self.forever or not self.restarted):
            self.restarted = True
            self.queue.put_nowait(("load", {"version": -1}, asyncio.get_running_loop().create_future()))
        return super().generate(step)


async def test_a_restarted_rollout_daemon_gets_the_weights_again() -> None:
    infos = await run(StalenessPolicy(1, "wait"), 4, Amnesiac(forever=False))
    assert max(i["async/staleness_max"] for i in infos) <= 1  # the version -1 samples were never trained on
    assert sum(i["async/dropped_batches"] for i in infos) >= 1


async def test_a_rollout_that_never_holds_new_weights_is_an_error_not_a_loop() -> None:
    with pytest.raises(RolloutError, match="keeps generating with version -1 although version 2 was sent"):
        await run(StalenessPolicy(0, "wait"), 4, Amnesiac(forever=True))


# -------------------------------------------------------------------- per-row drop, partial rollouts


def groups_batch(spec: list[tuple[str, list[int]]]) -> BatchHandle:
    """A rollout of prompt groups: (uid, the weight_version of each of its rows)."""
    uids = [uid for uid, versions in spec for _ in versions]
    versions = [v for _, versions in spec for v in versions]
    return BatchHandle.inline({"uid": uids, "weight_version": versions}, {"timing/generate_s": 0.001})


async def take_one(policy: StalenessPolicy, answers: list[BatchHandle], steps: int = 1) -> tuple[BatchHandle, dict[str, float], list[list[str]]]:
    """Start a pipeline at version `steps - 1` whose rollouts are `answers` in turn; take that step.
    Also returns the prompts each generate call got."""
    rollout, asked = FakeRollout(), []
    prompts = BatchHandle.inline({"prompt": ["p0", "p1", "p2", "p3"]})

    async def generate(step: int, given: BatchHandle) -> BatchHandle:
        asked.append([p for shard in given.shards for p in shard.non_tensor["prompt"]])
        return answers[len(asked) - 1]

    pipeline = RolloutPipeline(WeightSync(FakeActor(), rollout), policy, generate, lambda: prompts, steps=steps)
    try:
        await pipeline.start(steps - 1)
        batch, info = await pipeline.take(steps - 1)
    finally:
        await pipeline.close()
        rollout.task.cancel()
    return batch, info, asked


async def test_drop_removes_too_old_prompt_groups_one_by_one() -> None:
    """Groups b and d hold a row from version 0 at step 1 with max_staleness 0: dropped whole;
    2 of 4 groups is enough with min_keep 0.5, so the step trains on a and c."""
    rollout = groups_batch([("a", [1, 1]), ("b", [0, 1]), ("c", [1, 1]), ("d", [0, 0])])
    batch, info, asked = await take_one(StalenessPolicy(0, "drop", ahead=0, min_keep=0.5), [rollout], steps=2)
    assert non_tensor(batch, "uid") == ["a", "a", "c", "c"] and len(asked) == 1
    assert info["async/dropped_rows"] == 4 and info["async/dropped_groups"] == 2 and info["async/dropped_batches"] == 0
    assert info["async/staleness_max"] == 0 and info["async/weight_version_min"] == 1


async def test_drop_tops_up_with_the_dropped_prompts_when_too_few_remain() -> None:
    rollout = groups_batch([("a", [1, 1]), ("b", [0, 1]), ("c", [1, 1]), ("d", [0, 0])])
    again = groups_batch([("b2", [1, 1]), ("d2", [1, 1])])
    batch, info, asked = await take_one(StalenessPolicy(0, "drop", ahead=0, min_keep=0.75), [rollout, again], steps=2)
    assert asked == [["p0", "p1", "p2", "p3"], ["p1", "p3"]]  # only the dropped groups' prompts, in order
    assert non_tensor(batch, "uid") == ["a", "a", "c", "c", "b2", "b2", "d2", "d2"]
    assert info["async/dropped_groups"] == 2 and info["async/dropped_batches"] == 1 and info["async/staleness_max"] == 0


async def test_wait_regenerates_every_too_old_group() -> None:
    rollout = groups_batch([("a", [1, 1]), ("b", [0, 1]), ("c", [1, 1]), ("d", [1, 1])])
    again = groups_batch([("b2", [1, 1])])
    batch, info, asked = await take_one(StalenessPolicy(0, "wait"), [rollout, again], steps=2)
    assert asked[1] == ["p1"] and non_tensor(batch, "uid") == ["a", "a", "c", "c", "d", "d", "b2", "b2"]
    assert info["async/dropped_rows"] == 2


def test_row_groups_and_runs() -> None:
    assert row_groups(groups_batch([("a", [0, 0]), ("b", [0]), ("c", [0, 0, 0])])) == [(0, 2), (2, 3), (3, 6)]
    assert row_groups(BatchHandle.inline({"weight_version": [0, 0, 0]})) == [(0, 3)]  # no uids: one group
    assert runs([(0, 2), (2, 3), (5, 6), (6, 8)]) == [(0, 3), (5, 8)]
    with pytest.raises(ValueError, match="stale_min_keep=1.5"):
        StalenessPolicy(1, "drop", min_keep=1.5)
    with pytest.raises(ValueError, match="partial_rollout_tokens=-1"):
        GRPOAsyncConfig.read({"partial_rollout_tokens": -1})


class SegmentedRollout:
    """generate_partial: unfinished for `segments - 1` calls, then the rollout."""

    def __init__(self, segments: int) -> None:
        self.segments = segments
        self.calls: list[tuple[BatchHandle, dict[str, Any]]] = []

    async def generate_partial(self, prompts: BatchHandle, **kw: Any) -> BatchHandle:
        self.calls.append((prompts, kw))
        if len(self.calls) < self.segments:
            return BatchHandle.inline({"finished": [False]}, {"unfinished": 1})
        return BatchHandle.inline({"weight_version": [0]}, {"segments": self.segments})


async def test_partial_rollout_continues_one_key_until_every_row_finished() -> None:
    rollout, prompts = SegmentedRollout(3), BatchHandle.inline({"prompt": ["1+1="]})
    out = await partial_rollout(rollout, prompts, segment_tokens=4, n=2, seed=7)
    assert out.meta["segments"] == 3 and len(rollout.calls) == 3
    keys = {kw["key"] for _, kw in rollout.calls}
    assert len(keys) == 1 and all(p is prompts and kw["segment_tokens"] == 4 and kw["seed"] == 7 for p, kw in rollout.calls)
