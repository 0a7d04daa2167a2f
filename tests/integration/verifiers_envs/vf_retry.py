"""A multi-turn verifiers 0.4 environment for hfrt's tests: the environment plays the user
host-side (as verifiers' TextArena environment does) — the model answers a sum, the environment
replies with a hint and asks again, and the reward (an env-side `record_reward`, plus the task's
own `@vf.reward` on the last reply) scores the second answer."""

from __future__ import annotations

import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["RetryEnv", "RetryTaskset"]


class RetryData(vf.TaskData):
    answer: str


class RetryTask(vf.Task[RetryData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def second_answer(self, task: RetryData, trace: vf.Trace) -> float:
        found = re.match(r"\s*(-?\d+)", trace.last_reply)
        return 1.0 if found is not None and found.group(1) == task.answer else 0.0


class RetryEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.player.interaction(task) as interaction:
            first = await interaction.turn()
            second = await interaction.turn(f"you said {first.last_reply[:8]!r}; the answer is {task.data.answer}. Again:")
        interaction.trace.record_reward("turns_taken", 0.25 if not second.terminated or second.last_reply else 0.0, 1.0)


class RetryTaskset(vf.Taskset[RetryTask, vf.TasksetConfig]):
    def load(self) -> Iterator[RetryTask]:
        for a, b in [(1, 2), (3, 4), (2, 5), (6, 1)]:
            yield RetryTask(RetryData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
