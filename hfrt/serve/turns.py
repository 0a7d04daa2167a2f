"""generate_turn calls on the rollout role, batched across concurrent callers (the agent loop's
conversations, the HTTP server's requests), and the Trajectory record a conversation's turns make
(its tokens, the mask of the tokens the policy sampled, their log-probs).

Controller-side (no torch): token ids travel as small lists. It knows the rollout role's
generate_turn endpoint and its row layout; nothing of HTTP, OpenAI fields, tools or algorithms.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hfrt.protocols import BatchHandle

#: how long one generate_turn call may take before its requests fail (a round on CPU takes seconds)
TURN_TIMEOUT_S = 300.0


def prompts_handle(columns: Mapping[str, list[Any]]) -> BatchHandle:
    """A batch of non-tensor columns made in the controller: one shard that no daemon owns, so the
    receiving ranks read their rows straight out of the handle."""
    return BatchHandle.inline(dict(columns))


def non_tensor(handle: BatchHandle, name: str) -> list[Any]:
    """A non-tensor column of a batch handle (carried inline in its shards: no bytes move)."""
    return [value for shard in handle.shards for value in shard.non_tensor.get(name, [])]


def frozen(value: Any) -> Any:
    """`value` as a hashable key (lists and tuples as tuples, tables as sorted item tuples): requests
    whose options freeze equal share a generate_turn call."""
    if isinstance(value, dict):
        return ("<table>", tuple(sorted((str(k), frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


class AgentGenerationError(RuntimeError):
    """A generate_turn call on the rollout role failed: the run cannot go on without generation.
    `rows`: how many requests that call carried; `__cause__`: the call's own error."""

    rows: int = 0


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

    def __init__(self, rollout: Any, *, flush_after_s: float = 0.05, seed: int | None = None, timeout_s: float = TURN_TIMEOUT_S,
                 batch_size: int | None = None, idle_flush: bool = False) -> None:
        self.rollout, self.flush_after_s, self.timeout_s = rollout, flush_after_s, timeout_s
        self.batch_size, self.idle_flush = batch_size, idle_flush
        self.in_flight = 0
        self.live = 0
        self.calls = 0
        self._seeds = itertools.count(seed) if seed is not None else None
        self._pending: list[tuple[Any, list[int], list[Any], asyncio.Future[dict[str, Any]], dict[str, Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def request(self, context: list[int], append: list[Any], options: dict[str, Any]) -> dict[str, Any]:
        """One turn of one conversation: its row of generate_turn's output."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((frozen(options), context, append, future, options))
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
        groups: dict[Any, list[Any]] = {}
        for entry in self._pending:
            groups.setdefault(entry[0], []).append(entry)
        self._pending = []
        loop = asyncio.get_running_loop()
        for entries in groups.values():
            self.in_flight += 1  # counted here: the task starts later, and a request may come first
            task = loop.create_task(self._call(dict(entries[0][4]), entries))
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


__all__ = ["AgentGenerationError", "TURN_TIMEOUT_S", "Trajectory", "TurnBatcher", "non_tensor", "prompts_handle"]
