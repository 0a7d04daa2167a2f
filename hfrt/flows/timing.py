"""StageTimer: the wall time of each stage and call of one step, and the start-early / await-late
helper that overlaps independent calls.

No torch: it awaits futures and reads the clock. It knows stage names only as the labels a flow
gives them; what a stage computes is the flow's business.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any


class StageTimer:
    """Wall time of each stage and call of one step, as `timing/<name>_s` metrics.

    Overlap is start early, await late: calling an endpoint sends it at once and returns a future,
    so independent calls made together run together, and `together` awaits them as one stage::

        values, ref, scores = await timer.together(
            "stage2", values=critic.compute_values(rollout),
            ref_log_prob=reference.compute_log_prob(rollout), reward=reward.score(rollout))

    records `timing/values_s`, `timing/ref_log_prob_s`, `timing/reward_s` (each call's own time)
    and `timing/stage2_s` (the stage's wall time, about the slowest of them, not their sum).
    """

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._start = time.perf_counter()

    async def one(self, name: str, call: Awaitable[Any]) -> Any:
        """Await one call as its own stage."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.timings[f"timing/{name}_s"] = time.perf_counter() - start

    async def together(self, stage: str, **calls: Awaitable[Any]) -> list[Any]:
        """Await calls already started, in keyword order; if one fails the others are cancelled."""
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

    def step_s(self) -> float:
        return time.perf_counter() - self._start
