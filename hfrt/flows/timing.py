"""StageTimer: the wall time of each stage and call of one step, and the start-early / await-late
helper that overlaps independent calls; Stage, the names of the stages the built-in flows time.

A built-in recipe names its stages once, with Stage: its STAGES table (what `hfrt plan` prices)
and its timer calls use the same members, and tests/flows/test_flow_stages.py runs a step of each
recipe and holds the stages its timer recorded to STAGES (plus the UNPRICED ones). No torch: it
awaits futures and reads the clock; what a stage computes is the flow's business.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class Stage(enum.StrEnum):
    """A stage of a built-in flow's step: its `timing/<stage>_s` metric, and its name in the
    recipe's STAGES table (a Stage is a str, so the table and the metrics read as before)."""

    #: the step's rollout (a generate call, or the rollout role's / the agents' samples)
    GENERATE = "generate"
    #: preparing experience: the reference, reward (and critic, cost) calls at once
    STAGE2 = "stage2"
    OLD_LOG_PROB = "old_log_prob"
    ADVANTAGES = "advantages"
    UPDATE = "update"
    #: ReMax: the sampled and the greedy rollouts with their stage 2, awaited together
    ROLLOUT = "rollout"
    #: ReMax: the greedy generation and its reward, beside the sampled ones
    GREEDY_GENERATE = "greedy_generate"
    GREEDY_REWARD = "greedy_reward"
    #: weight sync to a rollout role (asynchronous and agent flows)
    SYNC = "sync"
    #: agent flows: the trajectories assembled into one batch
    ASSEMBLE = "assemble"
    #: dpo: the reference's log-probs of the step's pairs (started while the previous update ran)
    REFERENCE = "reference"


#: stages a step times that `hfrt plan` does not list in STAGES: their calls are priced inside a
#: listed stage (ReMax's greedy ones, under generate and stage2) or cost no model pass of note
#: (advantages on the actor's rank 0, weight sync, assembling trajectories)
UNPRICED = frozenset({Stage.ADVANTAGES, Stage.ROLLOUT, Stage.GREEDY_GENERATE, Stage.GREEDY_REWARD, Stage.SYNC, Stage.ASSEMBLE})


#: a recipe's STAGES, read by `hfrt plan` (hfrt.deploy.plan): each stage in step order and the
#: calls made in it, role → ops (generate, forward, train; *_greedy, forward_offpolicy)
StageTable = tuple[tuple[Stage, dict[str, tuple[str, ...]]], ...]


class StageTimer:
    """Wall time of each stage and call of one step, as `timing/<name>_s` metrics.

    Overlap is start early, await late: calling an endpoint sends it at once and returns a future,
    so independent calls made together run together, and `together` awaits them as one stage::

        values, ref, scores = await timer.together(
            "stage2", values=critic.compute_values(rollout),
            ref_log_prob=reference.compute_log_prob(rollout), reward=reward.score(rollout))

    records `timing/values_s`, `timing/ref_log_prob_s`, `timing/reward_s` (each call's own time)
    and `timing/stage2_s` (the stage's wall time, about the slowest of them, not their sum).
    `stages` lists the stage names timed, in the order they started (a built-in flow's are Stage
    members; a flow of your own may use any string).
    """

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.stages: list[str] = []
        self._start = time.perf_counter()

    async def one(self, name: str, call: Awaitable[T]) -> T:
        """Await one call as its own stage."""
        self.stages.append(name)
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.timings[f"timing/{name}_s"] = time.perf_counter() - start

    async def together(self, stage: str, **calls: Awaitable[Any]) -> list[Any]:
        """Await calls already started, in keyword order; if one fails the others are cancelled."""
        self.stages.append(stage)
        start = time.perf_counter()

        async def timed(name: str, call: Awaitable[Any]) -> Any:
            result = await call
            self.timings[f"timing/{name}_s"] = time.perf_counter() - start
            return result

        tasks = [asyncio.ensure_future(timed(name, call)) for name, call in calls.items()]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        finally:
            self.timings[f"timing/{stage}_s"] = time.perf_counter() - start

    def record(self, stage: str, seconds: float) -> None:
        """Record a stage timed elsewhere (e.g. streamed generation: hfrt.flows.streaming)."""
        self.stages.append(stage)
        self.timings[f"timing/{stage}_s"] = seconds

    def step_s(self) -> float:
        return time.perf_counter() - self._start
