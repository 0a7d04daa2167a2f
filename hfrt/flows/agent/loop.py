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
import functools
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hfrt.flows.agent.sandbox import SandboxLimits, SandboxResult, ToolError, call_tool, run_python
from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.protocols import BatchHandle

AgentFn = Callable[["Conversation", dict[str, Any]], Awaitable[float]]


class ConversationLimit(RuntimeError):
    """A conversation reached max_turns or max_total_tokens (ends that sample, as a tool error does)."""


class AgentGenerationError(RuntimeError):
    """A generate_turn call on the rollout role failed: the run cannot go on without generation.
    `rows`: how many requests that call carried; `__cause__`: the call's own error."""

    rows: int = 0


@dataclass(frozen=True)
class Turn:
    """One sampled turn: its token ids, their log-probs, its text and the weight version used."""

    ids: list[int]
    log_probs: list[float]
    text: str
    weight_version: int


@dataclass
class Trajectory:
    """A finished conversation. response_* cover every token after the prompt; gen_mask is 1 on
    tokens the policy sampled (0 on tool outputs and other appended text)."""

    sample: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    gen_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    reward: float = 0.0
    error: str = ""
    turns: int = 0
    weight_versions: list[int] = field(default_factory=list)


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


class TurnBatcher:
    """Collects turn requests of concurrent conversations into generate_turn calls (one per set of
    sampling options), sent when all live conversations wait or flush_after_s after the first.
    With `batch_size` (for callers that cannot count live conversations, such as an HTTP server)
    a round goes out when that many requests wait instead; with `idle_flush` also at once when no
    call is in flight (requests that come while one runs go together in the next).

    It owns the calls it starts (`tasks()`): when one is done, however it ended, it is no longer
    counted in flight, and requests it did not answer fail with its error (or are cancelled with
    it), so no request waits on a call that will never answer."""

    #: the generate_turn columns every row gets back; OPTIONAL_COLUMNS only when the role returns them
    COLUMNS: tuple[str, ...] = ("appended", "turn_ids", "turn_log_probs", "turn_text", "weight_version")
    OPTIONAL_COLUMNS: tuple[str, ...] = ()

    def __init__(self, rollout: Any, *, flush_after_s: float = 0.05, seed: int | None = None, timeout_s: float = CALL_TIMEOUT_S,
                 batch_size: int | None = None, idle_flush: bool = False) -> None:
        self.rollout, self.flush_after_s, self.timeout_s = rollout, flush_after_s, timeout_s
        self.batch_size, self.idle_flush = batch_size, idle_flush
        self.in_flight = 0
        self.live = 0
        self.calls = 0
        self._seeds = itertools.count(seed) if seed is not None else None
        self._pending: list[tuple[tuple[Any, ...], list[int], list[Any], asyncio.Future[dict[str, Any]]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def request(self, context: list[int], append: list[Any], options: dict[str, Any]) -> dict[str, Any]:
        """One turn of one conversation: its row of generate_turn's output."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
        self._pending.append((key, context, append, future))
        self._maybe_flush()
        return await future

    def done(self) -> None:
        """A conversation finished: it no longer holds a round back."""
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        full = len(self._pending) >= (self.live if self.batch_size is None else self.batch_size)
        if self._pending and (full or (self.idle_flush and self.in_flight == 0)):
            self._flush()
        elif self._pending and self._timer is None and not self.idle_flush:
            self._timer = asyncio.get_running_loop().call_later(self.flush_after_s, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for entry in self._pending:
            groups.setdefault(entry[0], []).append(entry)
        self._pending = []
        loop = asyncio.get_running_loop()
        for key, entries in groups.items():
            self.in_flight += 1  # counted here: the task starts later, and a request may come first
            task = loop.create_task(self._call(dict(key), entries))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._call_done, entries))

    def tasks(self) -> set[asyncio.Task[None]]:
        """The generate_turn calls running now (for an owner that stops early to cancel)."""
        return set(self._tasks)

    def _call_done(self, entries: list[Any], task: asyncio.Task[None]) -> None:
        """However the call ended: no longer in flight, and no request left waiting on it."""
        self._tasks.discard(task)
        self.in_flight -= 1
        for e in entries:
            if e[3].done():
                continue
            if task.cancelled():
                e[3].cancel()
            else:
                e[3].set_exception(task.exception() or RuntimeError("generate_turn call ended without answering"))
        if self.idle_flush:
            self._maybe_flush()

    async def _call(self, options: dict[str, Any], entries: list[Any]) -> None:
        handle = prompts_handle({"context": [e[1] for e in entries], "append": [e[2] for e in entries]})
        options = {k: {"strings": list(v)} if k == "stop" else v for k, v in options.items()}
        if self._seeds is not None:
            options = {**options, "seed": next(self._seeds)}
        self.calls += 1
        await self._send(handle, options, entries)

    async def _send(self, handle: BatchHandle, options: dict[str, Any], entries: list[Any]) -> None:
        try:
            out = await self.rollout.generate_turn(handle, **options, timeout_s=self.timeout_s)
            columns = {c: non_tensor(out, c) for c in self.COLUMNS}
            columns |= {c: v for c in self.OPTIONAL_COLUMNS if (v := non_tensor(out, c))}  # those returned
        except Exception as exc:
            error = AgentGenerationError(f"generate_turn on the rollout role failed for {len(entries)} conversations: {exc}")
            error.rows, error.__cause__ = len(entries), exc
            for e in entries:
                if not e[3].done():
                    e[3].set_exception(error)
            return
        for row, e in enumerate(entries):
            if not e[3].done():
                e[3].set_result({c: v[row] for c, v in columns.items()})


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
        """The policy's next turn (ends at a `stop` string, eos or max_new_tokens)."""
        t, cfg = self.trajectory, self.cfg
        if t.turns >= cfg.max_turns:
            raise ConversationLimit(f"the conversation reached max_turns={cfg.max_turns}")
        budget = min(max_new_tokens or cfg.max_new_tokens, cfg.max_total_tokens - self.tokens)
        if budget < 1:
            raise ConversationLimit(f"the conversation reached max_total_tokens={cfg.max_total_tokens}")
        options = {"max_new_tokens": budget, "temperature": cfg.temperature, "stop": list(stop), **sampling}
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


async def run_agents(rollout: Any, agent: AgentFn, samples: Sequence[dict[str, Any]], cfg: AgentConfig | None = None) -> list[Trajectory]:
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


async def assemble(rollout: Any, trajectories: Sequence[Trajectory], carry: Sequence[str] = (), *, timeout_s: float = CALL_TIMEOUT_S) -> BatchHandle:
    """The trajectories as a rollout batch (roles/rollout.py layout, response_mask 0 on appended
    text) made on the rollout daemons; the actor trains on the handle."""
    columns = trajectory_columns(trajectories, carry)
    if not columns["prompt_ids"]:
        raise ValueError("no trajectory reached its first turn: nothing to train on")
    return await rollout.assemble_trajectories(prompts_handle(columns), timeout_s=timeout_s)


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
