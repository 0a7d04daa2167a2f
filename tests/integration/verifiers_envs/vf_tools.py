"""A tool-using verifiers 0.4 environment for hfrt's tests: the task offers a `hint` tool (an MCP
tool server verifiers starts per rollout, here as a subprocess of the runner) and asks for a sum;
the task's reward is the exact answer in the last reply, its metric the tool calls made. Its
seat's sampling asks for a tool call on every turn (`tool_choice: required`), so a rollout ends
at max_turns with the tool called."""

from __future__ import annotations

import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["AddEnv", "AddTaskset"]


class AddTools(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None

    @vf.tool
    async def hint(self) -> str:
        """How to answer (no arguments: a forced call of the random tiny model stays short)."""
        return "add the two numbers and reply with the sum alone"


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [AddTools(vf.ToolsetConfig())]

    @vf.reward
    async def exact_answer(self, task: AddData, trace: vf.Trace) -> float:
        found = re.search(r"(-?\d+)\s*$", trace.last_reply)
        return 1.0 if found is not None and found.group(1) == task.answer else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class AddEnvConfig(vf.EnvConfig):
    #: the seat's own sampling default, kept under hfrt's max_tokens / temperature: every turn must
    #: call a tool (the random tiny model would not), so the tool server is exercised
    agent: vf.AgentConfig = vf.AgentConfig(sampling=vf.SamplingConfig(tool_choice="required"))


class AddEnv(vf.Env[AddEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.agent.run(task)


class AddTaskset(vf.Taskset[AddTask, vf.TasksetConfig]):
    def load(self) -> Iterator[AddTask]:
        for a, b in [(12, 30), (7, 8)]:
            yield AddTask(AddData(prompt=f"What is {a}+{b}? Call the hint tool first.", answer=str(a + b)), self.config.task)


if __name__ == "__main__":
    AddTools.run()
