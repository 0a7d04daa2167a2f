"""The addition task as a verifiers 0.4 environment, for the figure "a verifiers environment trains
for a few steps with its reward rising" (bench/recipes/figures.py, check `verifiers`): one-digit
sums `a+b=` built in code, scored by the task's own rewards — the exact sum (weight 1) and a format
reward, the share of the reply's characters that are digits (weight 0.5), which a byte-level model
from random weights can climb in tens of steps. Runs in the verifiers venv (imports verifiers only)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["AdditionTaskset"]


class AdditionConfig(vf.TasksetConfig):
    size: int = 256
    seed: int = 0


class AdditionData(vf.TaskData):
    answer: str


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact_sum(self, task: AdditionData, trace: vf.Trace) -> float:
        found = re.match(r"\s*(\d+)", trace.last_reply)
        return 1.0 if found is not None and found.group(1) == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> Iterator[AdditionTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield AdditionTask(AdditionData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
