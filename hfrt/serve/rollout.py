"""The server's side of the rollout role: what it learns of the model once (its context and the
most bytes a token spells), whether the role can be called now (503 while a dead daemon is being
replaced), and the three ways a turn is sampled — batched generate_turn calls, a long turn in
chunks of calls that each continue the exact ids so far, and a token stream (generate_turn_stream).

Controller-side (no torch). It knows the rollout role's endpoints and their rows; nothing of HTTP,
OpenAI fields, sessions or tokenizers. Every failed call becomes an ApiError (http_error).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from hfrt.log import get_logger
from hfrt.serve.errors import ApiError, BadRequest
from hfrt.serve.turns import TURN_TIMEOUT_S, AgentGenerationError, TurnBatcher
from hfrt.wire.errors import CallTimeout, ContextTooLong, DaemonGone, RemoteError

#: remote error types that mean the request's input was refused (a 400, not a server fault),
#: besides any error naming the refused argument (RemoteError.param)
INPUT_ERRORS = ("ValueError", "TypeError", "KeyError")
#: what a 503 tells a client to wait while a dead rollout daemon is being replaced (seconds)
RETRY_AFTER_S = 5


class RowBatcher(TurnBatcher):
    """A TurnBatcher whose rows also carry generate_turn's optional columns (text pieces, top
    log-probs) when the call returned them."""

    OPTIONAL_COLUMNS = ("turn_pieces", "turn_top", "turn_finished", "turn_stop_text")


@dataclass(frozen=True)
class ModelInfo:
    """What the rollout role said of its model (serving_info): the context in tokens (None:
    unknown) and the most UTF-8 bytes one token spells."""

    context_tokens: int | None = None
    max_token_bytes: int = 1
    template_sees_tools: bool | None = None  # whether the model's chat template renders `tools` (None: unknown)
    tool_templates: list[str] | None = None  # the built-in tool templates the role has

    @property
    def max_text_bytes(self) -> int | None:
        """Text longer than this cannot fit the context whatever it tokenises to (None: no cap)."""
        return None if self.context_tokens is None else self.context_tokens * self.max_token_bytes


def declares(rollout: Any, name: str, *, stream: bool = False) -> bool:
    """Whether role group `rollout` declares endpoint `name` (with `stream`: as a streaming one)."""
    endpoints = getattr(rollout, "endpoints", None)
    if not isinstance(endpoints, dict) or name not in endpoints:
        return False
    return not stream or (bool((endpoints.get(name) or {}).get("stream")) and bool(getattr(rollout, "daemons", None)))


class RolloutClient:
    """The rollout role as the server calls it. `replacing()` says whether recovery is replacing a
    dead daemon of the role now (hfrt serve-openai runs with recovery on); while one is dead the
    server answers 503 with Retry-After when it is being replaced, plain 503 when it is not."""

    def __init__(self, rollout: Any, *, batch_size: int, flush_after_s: float, idle_flush: bool, timeout_s: float = TURN_TIMEOUT_S,
                 token_stream: bool = True, replacing: Callable[[], bool] | None = None) -> None:
        self.rollout, self.timeout_s, self.replacing = rollout, timeout_s, replacing
        kw: dict[str, Any] = {"timeout_s": timeout_s, "batch_size": batch_size, "idle_flush": idle_flush}
        self.batcher = RowBatcher(rollout, flush_after_s=flush_after_s, **kw)
        self.long = RowBatcher(rollout, flush_after_s=flush_after_s, **kw)
        self.alone = RowBatcher(rollout, flush_after_s=0.0, timeout_s=timeout_s, batch_size=1)
        self.can_stream = token_stream and declares(rollout, "generate_turn_stream", stream=True)
        self.token_streams = 0  # streamed turns sampled token by token (the rest, in chunks)
        self._info: ModelInfo | None = None

    @property
    def calls(self) -> int:
        """generate_turn calls sent so far (batched rounds plus one-at-a-time retries)."""
        return self.batcher.calls + self.long.calls + self.alone.calls

    async def info(self) -> ModelInfo:
        """The model's context and token size, asked of the role once (a role without serving_info: unknown)."""
        if self._info is None:
            info = ModelInfo()
            if declares(self.rollout, "serving_info"):
                self.check_available()
                try:
                    first = (await self.rollout.serving_info(timeout_s=self.timeout_s))[0]
                except (RemoteError, DaemonGone, CallTimeout) as exc:
                    raise _failed(exc, "completion", "serving_info") from exc
                info = ModelInfo(first.get("context_tokens"), int(first.get("max_token_bytes") or 1), first.get("template_sees_tools"),
                                 first.get("tool_templates"))
            self._info = info
        return self._info

    def check_available(self) -> None:
        """503 when a daemon of the role is gone: with Retry-After while recovery replaces it."""
        gone = [d for d in getattr(self.rollout, "daemons", None) or [] if not getattr(d, "alive", True)]
        if not gone:
            return
        if self.replacing is not None and self.replacing():
            raise ApiError(503, f"the rollout role is restarting a daemon that stopped: retry in about {RETRY_AFTER_S} s",
                           code="restarting", headers={"Retry-After": str(RETRY_AFTER_S)})
        raise ApiError(503, "the rollout role is unavailable: its daemon stopped and is not being replaced", code="unavailable")

    async def generate(self, batcher: TurnBatcher, context: list[int], append: list[Any], options: dict[str, Any],
                       kind: str) -> dict[str, Any]:
        """One row of a batched generate_turn call; a failed batch is retried one request at a
        time, so one bad request cannot fail the others batched with it."""
        self.check_available()
        try:
            return await batcher.request(context, append, options)
        except AgentGenerationError as exc:
            if exc.rows <= 1 or not isinstance(exc.__cause__, RemoteError):
                raise self.http_error(exc, kind) from exc
            try:  # one bad row fails its whole batch: find out whether it was this one
                return await self.alone.request(context, append, options)
            except AgentGenerationError as alone:
                raise self.http_error(alone, kind) from alone

    async def chunks(self, batcher: TurnBatcher, context: list[int], append: list[Any], options: dict[str, Any],
                     kind: str, chunk: int) -> AsyncIterator[dict[str, Any]]:
        """One choice sampled `chunk` tokens per call, each call's row as it comes: each chunk's
        context is the prompt plus every token sampled so far, so the turn is the same token
        sequence a single call would sample (its log-probs each conditioned on exactly the tokens
        before it); the last row's turn_text is the whole turn's text. The request's length is
        checked once, by the first call (request_max_tokens); later calls only fit what the
        context leaves, and a context that fills ends the turn (finish_reason length)."""
        total, fit = int(options["max_new_tokens"]), bool(options.get("fit_context"))
        first = {**options, "max_new_tokens": min(chunk, total), **({} if fit else {"request_max_tokens": total})}
        step = await self.generate(batcher, context, append, first, kind)
        yield step
        prompt = list(context) + [t for piece in step["appended"] for t in piece]
        got, finished, rounds = list(step["turn_ids"]), step.get("turn_finished", True), 0
        while not finished and len(got) < total:
            rounds += 1
            more = {**options, "max_new_tokens": min(chunk, total - len(got)), "text_prefix": len(got), "fit_context": True}
            if "seed" in more:
                more["seed"] = (int(more["seed"]) + rounds) % 2**63
            try:
                step = await self.generate(batcher, prompt + got, [], more, kind)
            except BadRequest:
                return  # the context is full: the turn ends here, cut (finish_reason length)
            yield {**step, "appended": []}
            got += list(step["turn_ids"])
            finished = step.get("turn_finished", True)

    async def chunked(self, context: list[int], append: list[Any], options: dict[str, Any], kind: str, chunk: int) -> dict[str, Any]:
        """One long choice sampled `chunk` tokens at a time (see chunks), as one row."""
        row: dict[str, Any] = {}
        async for step in self.chunks(self.long, context, append, options, kind, chunk):
            row = merge_rows(row, step)
        return row

    async def token_steps(self, context: list[int], append: list[Any], options: dict[str, Any], kind: str) -> AsyncGenerator[Any, None]:
        """One choice token by token from the rollout daemon's generate_turn_stream (one call: one
        prefill, then each token as it is sampled, on a rank picked round-robin). Yields True once
        the call started (False when the role's engine cannot stream: nothing was sampled, and
        later turns go in chunks), then a one-token row per token, then {"final": the daemon's
        whole row}. Closing this generator (the client went away) cancels the call, which stops
        the daemon's sampling."""
        self.check_available()
        daemons = self.rollout.daemons
        rank = daemons[self.token_streams % len(daemons)].rank
        opts = {k: {"strings": list(v)} if k == "stop" else v for k, v in options.items() if k != "pieces"}
        call = self.rollout.generate_turn_stream.stream(rank, context, append, timeout_s=self.timeout_s, **opts)
        try:
            try:
                head = await anext(call)
            except RemoteError as exc:
                if exc.type_name == "NotImplementedError":
                    self.can_stream = False
                    yield False
                    return
                raise _failed(exc, kind) from exc
            except (DaemonGone, CallTimeout) as exc:
                raise _failed(exc, kind) from exc
            self.token_streams += 1
            yield True
            appended, version = head["appended"], head["weight_version"]
            try:
                async for token in call:
                    yield {"appended": appended, "turn_ids": [token["id"]], "turn_log_probs": [token["logprob"]], "turn_text": token["text"],
                           "turn_pieces": [token["text"]], "weight_version": version, **({"turn_top": [token["top"]]} if "top" in token else {})}
                    appended = []
                yield {"final": await call.result()}
            except (RemoteError, DaemonGone, CallTimeout) as exc:
                raise _failed(exc, kind) from exc
        finally:
            await call.aclose()  # a client gone mid-turn: the daemon stops sampling before its next token

    def http_error(self, exc: AgentGenerationError, kind: str = "completion") -> ApiError:
        """http_error, with Retry-After when the call failed because a daemon that recovery is
        replacing went away."""
        error = http_error(exc, kind)
        if error.status == 503 and self.replacing is not None and self.replacing():
            error.headers = {"Retry-After": str(RETRY_AFTER_S)}
        return error


def http_error(exc: AgentGenerationError, kind: str = "completion") -> ApiError:
    """400 when the rollout daemon refused the input (the field named), 503 when it is gone or
    timed out, else 500; the client hears no server paths, logs or tracebacks (the log has them)."""
    cause = exc.__cause__
    if isinstance(cause, RemoteError) and (cause.param is not None or cause.type_name in INPUT_ERRORS):
        return _refusal(cause, kind)
    incident = uuid.uuid4().hex[:12]
    get_logger(part="openai_server").warning("generation_failed", incident=incident, error=f"{type(cause).__name__}: {cause or exc}")
    if isinstance(cause, (DaemonGone, CallTimeout)):
        return ApiError(503, f"the rollout role is unavailable (incident {incident}; the server log has the details)")
    where = f"{cause.where} raised {cause.type_name}" if isinstance(cause, RemoteError) else type(cause).__name__
    return ApiError(500, f"generate_turn failed: {where} (incident {incident}; the server log has the details)")


def _refusal(cause: RemoteError, kind: str) -> BadRequest:
    """The daemon's refusal of the input as a 400 naming the request field it was about: the
    argument the daemon named (`cause.param`; the conversation, "prompt", is a chat's `messages`),
    with OpenAI's context_length_exceeded when it did not fit the model's context (ContextTooLong)."""
    param = cause.param
    if param == "prompt" and kind in ("chat", "responses"):
        param = "messages"
    if param == "json_schema":  # the constraint made of response_format (or of a forced tool call)
        param = "response_format"
    code = "context_length_exceeded" if cause.type_name == ContextTooLong.__name__ else None
    text = cause.message
    text = text.split(": ", 1)[-1] if text.startswith("generate_turn row") else text
    text = text.split(": ", 1)[-1] if cause.param is not None and text.startswith(f"{cause.param}: ") else text
    return BadRequest(param, f"the rollout daemon refused the request: {text}", code=code)


def _failed(exc: Exception, kind: str, endpoint: str = "generate_turn_stream") -> ApiError:
    """A failed call other than generate_turn as the HTTP error a failed generate_turn call gets."""
    error = AgentGenerationError(f"{endpoint} on the rollout role failed: {exc}")
    error.rows, error.__cause__ = 1, exc
    return http_error(error, kind)


def merge_rows(row: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """A turn's row so far (empty at first) with the next chunk's row appended: ids, log-probs,
    pieces and top alternatives concatenated; text, finished and the oldest weight version from the
    chunk (its turn_text decodes the whole turn, see generate_turn's text_prefix)."""
    if not row:
        return {k: list(v) if isinstance(v, list) else v for k, v in step.items()}
    out = dict(row)
    for k in ("turn_ids", "turn_log_probs", "turn_pieces", "turn_top"):
        if k in out or k in step:
            out[k] = list(out.get(k) or []) + list(step.get(k) or [])
    out.update({"turn_text": step["turn_text"], "turn_finished": step.get("turn_finished", True),
                "turn_stop_text": step.get("turn_stop_text", ""),
                "weight_version": min(int(row["weight_version"]), int(step["weight_version"]))})
    return out
