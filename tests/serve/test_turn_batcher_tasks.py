"""TurnBatcher owns the generate_turn calls it starts (pure logic, scripted rollout role): a call
that fails before it reaches the role, or is cancelled before it starts, fails its waiting
requests at once instead of leaving them hanging, and the batcher's count of calls in flight
comes back to zero either way."""

from __future__ import annotations

import asyncio

import pytest

from hfrt.serve.turns import TurnBatcher
from tests.flows.test_agent_loop import ScriptedRollout

pytestmark = pytest.mark.timeout(30)

GOOD = {"max_new_tokens": 2, "temperature": 1.0, "stop": []}
BAD_STOP = {"max_new_tokens": 2, "temperature": 1.0, "stop": 5}  # stop strings must be a list: the batch cannot be built


async def test_a_batch_that_cannot_be_built_fails_its_waiting_requests_within_a_second() -> None:
    rollout = ScriptedRollout()
    batcher = TurnBatcher(rollout, flush_after_s=0.01, batch_size=2)
    waiting = [asyncio.ensure_future(batcher.request([i], [], BAD_STOP)) for i in range(2)]
    done, pending = await asyncio.wait(waiting, timeout=1.0)
    assert not pending, "requests of a batch that could not be built still wait after 1s"
    for future in done:
        assert isinstance(future.exception(), TypeError), future.exception()
    assert batcher.in_flight == 0 and rollout.calls == []
    ok = await asyncio.wait_for(asyncio.gather(*(batcher.request([i], [], GOOD) for i in range(2))), 1.0)
    assert [row["turn_text"] for row in ok] == ["ab", "ab"]  # the batcher goes on serving


async def test_a_call_cancelled_before_it_starts_cancels_its_requests_and_is_not_counted() -> None:
    batcher = TurnBatcher(ScriptedRollout(), flush_after_s=10.0, batch_size=1)
    request = asyncio.ensure_future(batcher.request([1], [], GOOD))
    await asyncio.sleep(0)  # the request is in, its call scheduled
    assert batcher.in_flight == 1
    for task in batcher.tasks():
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(request, 1.0)
    assert batcher.in_flight == 0 and not batcher.tasks()


async def test_finished_calls_are_not_kept() -> None:
    batcher = TurnBatcher(ScriptedRollout(), flush_after_s=0.01, batch_size=3)
    await asyncio.wait_for(asyncio.gather(*(batcher.request([i], [], GOOD) for i in range(3))), 1.0)
    await asyncio.sleep(0)
    assert batcher.in_flight == 0 and not batcher.tasks() and batcher.calls == 1
