"""A single-turn verifiers 0.4 environment for hfrt's tests: a sum to complete, scored by the
task's own exact-answer reward (the reply's leading number equals the sum: 1, else 0). Its tasks
are built in code (no dataset download); `size` and `seed` are taskset config keys."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["SumTaskset"]


class SumConfig(vf.TasksetConfig):
    size: int = 16
    seed: int = 0


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact_answer(self, task: SumData, trace: vf.Trace) -> float:
        found = re.match(r"\s*(-?\d+)", trace.last_reply)
        return 1.0 if found is not None and found.group(1) == task.answer else 0.0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> Iterator[SumTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
