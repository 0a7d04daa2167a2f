"""The agent loop API: a user's `async def agent(conv, sample) -> reward` talks to the rollout role
turn by turn, token-in/token-out, calls tools, and each conversation becomes a trajectory (its
tokens, a mask of the tokens the policy sampled, their rollout log-probs, a reward, an error).

Many conversations run concurrently; their turns are batched into one `generate_turn` call per
round (`TurnBatcher`): a round goes out once every live conversation is waiting for a turn, or
`flush_after_s` after the first request (so a slow tool never holds the others back). A tool that
hangs or raises ends its own sample (reward `error_reward`, the error recorded); a failed
generation call fails the run. No torch: token ids travel as small lists, tensors are made on the
rollout daemons (`assemble_trajectories`). It knows nothing of the algorithm that trains on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hfrt.flows.agent.sandbox import SandboxLimits, SandboxResult, ToolError, call_tool, run_python
from hfrt.flows.batches import prompts_handle
from hfrt.protocols import BatchHandle
from hfrt.serve.turns import AgentGenerationError, Trajectory, TurnBatcher
from hfrt.wire.role_views import Turns

AgentFn = Callable[["Conversation", dict[str, Any]], Awaitable[float]]


class ConversationLimit(RuntimeError):
    """A conversation reached max_turns or max_total_tokens (ends that sample, as a tool error does)."""


@dataclass(frozen=True)
class Turn:
    """One sampled turn: its token ids, their log-probs, its text and the weight version used."""

    ids: list[int]
    log_probs: list[float]
    text: str
    weight_version: int


@dataclass(frozen=True)
class AgentConfig:
    """How conversations are sampled: per-turn sampling, the token budget of a whole
    conversation, the per-sample time limit, the reward of a sample that ended in an error."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    max_total_tokens: int = 256
    max_turns: int = 8
    sample_timeout_s: float = 120.0
    error_reward: float = 0.0
    flush_after_s: float = 0.05
    seed: int | None = None


class Conversation:
    """One sample's conversation, handed to the agent function. `generate` samples the policy's
    next turn (after whatever `add` queued); `add` queues text (tool output, a user message)
    that is tokenised on the rollout daemon and masked out of training; `tool` and `run_code`
    call tools under time limits, raising ToolError (which ends the sample) on a hang or crash."""

    def __init__(self, sample: dict[str, Any], batcher: TurnBatcher, cfg: AgentConfig) -> None:
        self.sample, self.batcher, self.cfg = sample, batcher, cfg
        self.trajectory = Trajectory(sample)
        self._queued: list[Any] = [sample["prompt"]]

    @property
    def tokens(self) -> int:
        return len(self.trajectory.prompt_ids) + len(self.trajectory.response_ids)

    def add(self, text: str) -> None:
        """Append text the policy did not generate (masked out of training)."""
        if not isinstance(text, str):
            raise TypeError(f"Conversation.add takes text, not {text!r:.80}")
        self._queued.append(text)

    async def generate(self, *, max_new_tokens: int | None = None, stop: Sequence[str] = (), **sampling: Any) -> Turn:
        """The policy's next turn (ends at a `stop` string, eos or max_new_tokens). Its text ends
        with the stop string that ended it, as its ids do (include_stop_str_in_output=False: without it)."""
        t, cfg = self.trajectory, self.cfg
        if t.turns >= cfg.max_turns:
            raise ConversationLimit(f"the conversation reached max_turns={cfg.max_turns}")
        budget = min(max_new_tokens or cfg.max_new_tokens, cfg.max_total_tokens - self.tokens)
        if budget < 1:
            raise ConversationLimit(f"the conversation reached max_total_tokens={cfg.max_total_tokens}")
        options = {"max_new_tokens": budget, "temperature": cfg.temperature, "stop": list(stop),
                   **({"include_stop_str_in_output": True} if stop else {}), **sampling}
        queued, self._queued = self._queued, []
        row = await self.batcher.request(t.prompt_ids + t.response_ids, queued, options)
        for index, piece in enumerate(row["appended"]):
            if not t.prompt_ids and index == 0:
                t.prompt_ids = list(piece)
            else:
                self._extend(piece, [0] * len(piece), [0.0] * len(piece))
        turn = Turn(list(row["turn_ids"]), list(row["turn_log_probs"]), str(row["turn_text"]), int(row["weight_version"]))
        self._extend(turn.ids, [1] * len(turn.ids), turn.log_probs)
        t.turns += 1
        t.weight_versions.append(turn.weight_version)
        return turn

    def _extend(self, ids: list[int], mask: list[int], log_probs: list[float]) -> None:
        t = self.trajectory
        t.response_ids += ids
        t.gen_mask += mask
        t.log_probs += log_probs

    async def tool(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 5.0) -> Any:
        """fn(*args) in a thread under a time limit (ToolError on a hang or an exception)."""
        return await call_tool(fn, *args, timeout_s=timeout_s)

    async def run_code(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        """Python code in the sandboxed subprocess; ToolError when it overran a limit."""
        result = await run_python(code, limits)
        if result.error:
            raise ToolError(f"sandboxed code stopped: {result.error}")
        return result


async def run_agents(rollout: Turns, agent: AgentFn, samples: Sequence[dict[str, Any]], cfg: AgentConfig | None = None) -> list[Trajectory]:
    """Run `agent` once per sample (each needs a `prompt`), concurrently, turns batched; the
    trajectories in sample order. Errors of a sample's own (tools, limits, its code) end that
    sample only; a failed generation call raises AgentGenerationError."""
    cfg = cfg or AgentConfig()
    batcher = TurnBatcher(rollout, flush_after_s=cfg.flush_after_s, seed=cfg.seed)
    convs = [Conversation(dict(s), batcher, cfg) for s in samples]
    batcher.live = len(convs)
    results = await asyncio.gather(*(_one(agent, c, cfg) for c in convs), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [c.trajectory for c in convs]


async def _one(agent: AgentFn, conv: Conversation, cfg: AgentConfig) -> None:
    t = conv.trajectory
    try:
        t.reward = float(await asyncio.wait_for(agent(conv, conv.sample), cfg.sample_timeout_s))
    except AgentGenerationError:
        raise
    except TimeoutError:
        t.reward, t.error = cfg.error_reward, f"the agent ran past sample_timeout_s={cfg.sample_timeout_s}"
    except Exception as exc:  # the sample's own failure: recorded, the run goes on
        named = isinstance(exc, (ToolError, ConversationLimit))  # their messages say what happened
        t.reward, t.error = cfg.error_reward, str(exc) if named else f"{type(exc).__name__}: {exc}"
    finally:
        conv.batcher.done()


#: Columns an agent rollout carries for a reward function besides the data's: the agent's reward,
#: its error ("" when none), its turns, and the sample's tool calls where the agent counts them.
AGENT_COLUMNS = ("agent_reward", "agent_error", "agent_turns", "tool_calls")


def trajectory_columns(trajectories: Sequence[Trajectory], carry: Sequence[str] = ()) -> dict[str, list[Any]]:
    """Non-tensor columns for `assemble_trajectories` (those with prompt tokens; a sample that
    failed before its first turn has none and is left out) plus the carried sample columns."""
    kept = [t for t in trajectories if t.prompt_ids]
    columns: dict[str, list[Any]] = {
        "prompt_ids": [t.prompt_ids for t in kept], "response_ids": [t.response_ids for t in kept],
        "response_gen_mask": [t.gen_mask for t in kept], "response_log_probs": [t.log_probs for t in kept],
        "agent_reward": [t.reward for t in kept], "agent_error": [t.error for t in kept],
        "agent_turns": [t.turns for t in kept],
        "weight_version": [min(t.weight_versions, default=-1) for t in kept],
    }
    for name in carry:
        columns[name] = [t.sample.get(name) for t in kept]
    return columns


async def assemble(rollout: Turns, trajectories: Sequence[Trajectory], carry: Sequence[str] = ()) -> BatchHandle:
    """The trajectories as a rollout batch (roles/rollout.py layout, response_mask 0 on appended
    text) made on the rollout daemons; the actor trains on the handle."""
    columns = trajectory_columns(trajectories, carry)
    if not columns["prompt_ids"]:
        raise ValueError("no trajectory reached its first turn: nothing to train on")
    return await rollout.assemble_trajectories(prompts_handle(columns))


def agent_reward(response: str, ground_truth: Any, agent_reward: float) -> float:
    """Reward function for the reward role (`function = "hfrt.flows.agent.loop:agent_reward"`): the
    reward the agent function returned, carried in the `agent_reward` column."""
    return float(agent_reward)


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """agent/reward_mean, error_rate, turns_mean, generated and appended tokens per sample."""
    count = max(len(trajectories), 1)
    return {
        "agent/reward_mean": sum(t.reward for t in trajectories) / count,
        "agent/error_rate": sum(1 for t in trajectories if t.error) / count,
        "agent/turns_mean": sum(t.turns for t in trajectories) / count,
        "agent/generated_tokens_mean": sum(sum(t.gen_mask) for t in trajectories) / count,
        "agent/tool_tokens_mean": sum(len(t.gen_mask) - sum(t.gen_mask) for t in trajectories) / count,
    }
