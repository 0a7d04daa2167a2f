"""An OpenAI-compatible HTTP endpoint on the rollout role, for external agent frameworks:
GET /v1/models, POST /v1/completions, POST /v1/chat/completions (tools, n, streaming, logprobs),
served by Starlette on uvicorn (hfrt.serve.app). Concurrent requests are batched
into generate_turn calls (TurnBatcher); responses carry the exact prompt and sampled token ids,
their log-probs and the weight version; requests with a session id (header X-Session-Id, or the
`user` field) are recorded so `trajectory(session)` gives the Trajectory to train on.

Controller-side (no torch). It knows the rollout role's generate_turn endpoint; nothing of
training, rewards or tokenizers (text and chats are tokenised on the rollout daemon).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from hfrt.log import get_logger
from hfrt.serve.api import ApiError, BadRequest, Limits, TurnRequest, _message, chat_request, completion_request
from hfrt.serve.responses import TurnResult, chat_body, completion_body, end_events, event_stream, stream_head, token_events
from hfrt.serve.sessions import Session, SessionCall, build_trajectories, build_trajectory
from hfrt.serve.tools import parser_for
from hfrt.serve.turns import TURN_TIMEOUT_S, AgentGenerationError, Trajectory, TurnBatcher
from hfrt.wire.errors import CallTimeout, DaemonGone, RemoteError

#: remote error types that mean the request's input was refused (a 400, not a server fault)
INPUT_ERRORS = ("ValueError", "TypeError", "KeyError")


@dataclass(frozen=True)
class ServerLimits:
    """What the server accepts; a request past one gets a 4xx JSON error naming it.

    max_body_bytes: request body size (413). max_tokens: max_tokens / max_completion_tokens (400).
    max_n: choices per request (400). max_concurrent_requests: requests in progress at once (429).
    request_timeout_s: one request's wall time (408). max_prompt_tokens: prompt length in tokens,
    checked on the rollout daemon (400; None: the model's context less max_tokens).
    long_request_tokens: a request whose prompt (estimated from its size) plus max_tokens is longer
    goes to separate batches and is sampled `long_chunk_tokens` at a time (each chunk continues
    the exact ids so far), so a short request waits at most one chunk of a long one. A streamed
    turn is sampled token by token on the rollout daemon (generate_turn_stream: one prefill, a KV
    cache kept for the turn, each token sent as it is sampled) when `token_stream` is on and the
    role's engine can (the HF engine); otherwise stream_chunk_tokens per generate_turn call, each
    call's tokens sent as they come."""

    max_body_bytes: int = 16 << 20
    max_tokens: int = 4096
    max_n: int = 16
    max_concurrent_requests: int = 512
    request_timeout_s: float = 600.0
    max_prompt_tokens: int | None = None
    long_request_tokens: int = 256
    long_chunk_tokens: int = 16
    stream_chunk_tokens: int = 4
    token_stream: bool = True


class RowBatcher(TurnBatcher):
    """A TurnBatcher whose rows also carry generate_turn's optional columns (text pieces, top
    log-probs) when the call returned them."""

    OPTIONAL_COLUMNS = ("turn_pieces", "turn_top", "turn_finished")


class OpenAIServer:
    """`async with OpenAIServer(rollout, model="tiny") as server:` serves on host:port (port 0:
    a free one; `server.url` is the base URL, e.g. http://127.0.0.1:PORT/v1).

    Batching: a generate_turn call goes out when `batch_size` requests wait or `flush_after_s`
    after the first (with `idle_flush`: at once when no call is in flight). Long requests (see
    ServerLimits.long_request_tokens) batch apart from short ones. A failed call is retried one
    request at a time, so one bad request cannot fail the others batched with it. `n` choices of
    a request are n rows of one call. A session records a call once it succeeded; with n > 1
    choice i is recorded as session `NAME#i`. With `api_key`, every /v1 request needs
    `Authorization: Bearer <api_key>` (401 otherwise, before anything is generated)."""

    def __init__(self, rollout: Any, *, host: str = "127.0.0.1", port: int = 0, model: str = "hfrt",
                 batch_size: int = 64, flush_after_s: float = 0.02, idle_flush: bool = False, limits: ServerLimits | None = None,
                 api_key: str | None = None, tool_parser: str = "hermes", max_sessions: int = 10_000,
                 timeout_s: float = TURN_TIMEOUT_S) -> None:
        self.rollout, self.model, self.limits = rollout, model, limits or ServerLimits()
        self.tool_parser = parser_for(tool_parser).name
        self.api_key = api_key or None
        kw: dict[str, Any] = {"timeout_s": timeout_s, "batch_size": batch_size, "idle_flush": idle_flush}
        self.batcher = RowBatcher(rollout, flush_after_s=flush_after_s, **kw)
        self._long = RowBatcher(rollout, flush_after_s=flush_after_s, **kw)
        self._alone = RowBatcher(rollout, flush_after_s=0.0, timeout_s=timeout_s, batch_size=1)
        self.sessions: dict[str, Session] = {}
        self.max_sessions, self.sessions_dropped = max_sessions, 0
        self.requests = 0
        self.created = int(time.time())
        self.host, self.port = host, port
        self._http: Any = None
        self.timeout_s = timeout_s
        self._token_streams = self.limits.token_stream and _streams(rollout, "generate_turn_stream")
        self.token_streams = 0  # streamed turns sampled token by token (the rest, in chunks)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def generate_calls(self) -> int:
        """generate_turn calls sent so far (batched rounds plus one-at-a-time retries)."""
        return self.batcher.calls + self._long.calls + self._alone.calls

    async def __aenter__(self) -> OpenAIServer:
        from hfrt.serve.app import HttpServer  # Starlette and uvicorn load with the server, not the API logic

        self._http = HttpServer(self, self.host, self.port)
        self.port = await self._http.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def serve_forever(self) -> None:
        """Serve until cancelled (Ctrl-C in `hfrt serve-openai`)."""
        await asyncio.Event().wait()

    # -- sessions -------------------------------------------------------------------------

    def trajectory(self, session: str) -> Trajectory:
        """The session's calls as one Trajectory (gen_mask 1 exactly on sampled tokens); KeyError
        for an unknown session, SessionDrift when a call's prompt does not extend the previous ids."""
        if session not in self.sessions:
            raise KeyError(f"no session {session!r} (known: {sorted(self.sessions)[:10]})")
        return build_trajectory(session, self.sessions[session])

    def trajectories(self, session: str) -> list[Trajectory]:
        """The session as exact trajectories even when its client re-renders its history (an agent
        framework that rewrites earlier turns): a call that does not extend the previous one starts
        the next trajectory (see sessions.build_trajectories)."""
        if session not in self.sessions:
            raise KeyError(f"no session {session!r} (known: {sorted(self.sessions)[:10]})")
        return build_trajectories(session, self.sessions[session])

    def end_session(self, session: str) -> Trajectory:
        """trajectory(session), then forget the session (sessions are kept until ended, at most
        max_sessions of them: the oldest is dropped to make room)."""
        t = self.trajectory(session)
        del self.sessions[session]
        return t

    def _session(self, name: str) -> Session:
        """The named session, made on first use; past max_sessions the oldest is dropped (logged)."""
        if name not in self.sessions and len(self.sessions) >= self.max_sessions:
            oldest = next(iter(self.sessions))
            del self.sessions[oldest]
            self.sessions_dropped += 1
            get_logger(part="openai_server").warning("session_dropped", session=oldest, max_sessions=self.max_sessions)
        return self.sessions.setdefault(name, Session())

    # -- requests -------------------------------------------------------------------------

    def completion_turn(self, body: Any) -> TurnRequest:
        return completion_request(body, limits=Limits(self.limits.max_tokens, self.limits.max_n))

    def chat_turn(self, body: Any) -> TurnRequest:
        return chat_request(body, limits=Limits(self.limits.max_tokens, self.limits.max_n), tool_parser=self.tool_parser)

    async def complete(self, turn: TurnRequest, session: str | None = None) -> tuple[list[TurnResult], dict[str, Any]]:
        """Sample `turn` (n choices), record it under `session` (or its `user`), and build the body."""
        name = session or turn.user
        results = await self.sample(turn, name)
        chat = turn.kind == "chat"
        body = chat_body(turn, results, self.model, self.tool_parser) if chat else completion_body(turn, results, self.model)
        if name:  # recorded once sampled; with n > 1 choice i as NAME#i
            for i, result in enumerate(results):
                self._record(name if turn.n == 1 else f"{name}#{i}", turn, result, body["choices"][i]["message"] if chat else None)
        return results, body

    async def sample(self, turn: TurnRequest, name: str | None) -> list[TurnResult]:
        """The n choices of `turn`, continuing session `name`'s exact ids where the request extends them."""
        if turn.model is not None and turn.model != self.model:
            raise BadRequest("model", f"{turn.model!r} does not exist: this server samples {self.model!r}", status=404, code="model_not_found")
        held = self.sessions.get(name if turn.n == 1 else f"{name}#0") if name else None
        context, append = self._continuation(turn, held)
        options, batcher = self._options(turn, context, append)
        if batcher is self._long:
            rows = await asyncio.gather(*(self._chunked(context, append, options, turn) for _ in range(turn.n)))
        else:
            rows = await asyncio.gather(*(self._generate(self.batcher, context, append, options, turn) for _ in range(turn.n)))
        return [TurnResult.from_row(context, row) for row in rows]

    def _record(self, name: str, turn: TurnRequest, result: TurnResult, message: dict[str, Any] | None) -> None:
        session = self._session(name)
        session.calls.append(SessionCall(result.prompt_ids, result.token_ids, result.log_probs, result.weight_version))
        session.text = turn.text_prompt + result.text if turn.text_prompt is not None else None
        session.chat = None
        if message is not None:  # the reply as returned, in the form a client's echo of it is checked in
            session.chat = (turn.messages + [_message(len(turn.messages), message)], [t.schema for t in turn.tools])

    @staticmethod
    def _continuation(turn: TurnRequest, session: Session | None) -> tuple[list[int], list[Any]]:
        """Continue a session's exact ids when the request extends what it holds: a text prompt
        that starts with the last prompt text + output text (only the new text is tokenised), or
        chat messages that start with the last messages + the reply as returned, with the same
        tools (only what the chat template renders past them is tokenised)."""
        if session is None or not session.calls:
            return turn.context, turn.append
        if turn.text_prompt is not None and session.text is not None and turn.text_prompt.startswith(session.text):
            rest = turn.text_prompt[len(session.text):]
            return session.ids, [rest] if rest else []
        if turn.kind == "chat" and session.chat is not None:
            held, tools = session.chat
            if len(turn.messages) > len(held) and turn.messages[:len(held)] == held and [t.schema for t in turn.tools] == tools:
                item = {"messages": turn.messages, "tools": tools or None, "after": len(held)}
                return session.ids, [item, turn.prefill] if turn.prefill else [item]
        return turn.context, turn.append

    async def _chunks(self, batcher: TurnBatcher, context: list[int], append: list[Any], options: dict[str, Any],
                      turn: TurnRequest, chunk: int) -> AsyncIterator[dict[str, Any]]:
        """One choice sampled `chunk` tokens per call, each call's row as it comes: each chunk's
        context is the prompt plus every token sampled so far, so the turn is the same token
        sequence a single call would sample (its log-probs each conditioned on exactly the tokens
        before it); the last row's turn_text is the whole turn's text."""
        total = int(options["max_new_tokens"])
        step = await self._generate(batcher, context, append, {**options, "max_new_tokens": min(chunk, total)}, turn)
        yield step
        prompt = list(context) + [t for piece in step["appended"] for t in piece]
        got, finished, rounds = list(step["turn_ids"]), step.get("turn_finished", True), 0
        while not finished and len(got) < total:
            rounds += 1
            more = {**options, "max_new_tokens": min(chunk, total - len(got)), "text_prefix": len(got)}
            if "seed" in more:
                more["seed"] = (int(more["seed"]) + rounds) % 2**63
            try:
                step = await self._generate(batcher, prompt + got, [], more, turn)
            except BadRequest:
                if not turn.options.get("fit_context"):
                    raise
                return  # max_tokens not given and the context is full: the turn ends here
            yield {**step, "appended": []}
            got += list(step["turn_ids"])
            finished = step.get("turn_finished", True)

    async def _chunked(self, context: list[int], append: list[Any], options: dict[str, Any], turn: TurnRequest) -> dict[str, Any]:
        """One long choice sampled long_chunk_tokens at a time (see _chunks), as one row."""
        row: dict[str, Any] = {}
        async for step in self._chunks(self._long, context, append, options, turn, self.limits.long_chunk_tokens):
            row = merge_rows(row, step)
        return row

    async def stream(self, turn: TurnRequest, session: str | None = None) -> AsyncIterator[bytes]:
        """`turn` as server-sent events sent as it is sampled: a chunk per token as the rollout daemon
        samples it (see _token_steps; else stream_chunk_tokens per generate_turn call, each call's
        tokens sent as they come), then the finish chunk (and usage); the session is recorded at the
        end. With n > 1 or tools the turn is sampled whole first (tool calls are parsed from the whole
        text), then sent a chunk per token."""
        name = session or turn.user
        if turn.n > 1 or turn.tools:
            results, body = await self.complete(turn, session)
            for event in event_stream(turn, results, body):
                yield event
            return
        if turn.model is not None and turn.model != self.model:
            raise BadRequest("model", f"{turn.model!r} does not exist: this server samples {self.model!r}", status=404, code="model_not_found")
        context, append = self._continuation(turn, self.sessions.get(name) if name else None)
        options, batcher = self._options(turn, context, append)
        head, row = stream_head(turn, self.model), dict[str, Any]()
        steps: AsyncIterator[Any] | None = None
        if self._token_streams:
            tokens = self._token_steps(context, append, options, turn)
            if await anext(tokens):
                steps = tokens
            else:  # the role cannot stream token by token: chunks from now on
                await tokens.aclose()
                self._token_streams = False
        if steps is None:
            steps = self._chunks(batcher, context, append, options, turn, self.limits.stream_chunk_tokens)
        sent = ""
        async for step in steps:
            if "final" in step:  # the daemon's whole row: the same tokens, with turn_text and turn_finished
                row = step["final"]
                continue
            part = TurnResult.from_row(context if not row else [], step)
            for event in token_events(turn, head, part, first=not row):
                yield event
            sent += "".join(part.pieces) if len(part.pieces) == len(part.token_ids) else part.text
            row = merge_rows(row, step)
        result = TurnResult.from_row(context, row)
        rest = result.text[len(sent):] if result.text.startswith(sent) else ""
        if rest:  # text the last pieces held back (a character cut at the turn's end): one chunk without a token
            for event in token_events(turn, head, TurnResult([], [], [], rest, result.weight_version, [rest]), first=False):
                yield event
        body = chat_body(turn, [result], self.model, self.tool_parser) if turn.kind == "chat" else completion_body(turn, [result], self.model)
        if name:
            self._record(name, turn, result, body["choices"][0]["message"] if turn.kind == "chat" else None)
        for event in end_events(turn, head, body):
            yield event

    async def _token_steps(self, context: list[int], append: list[Any], options: dict[str, Any],
                           turn: TurnRequest) -> AsyncGenerator[Any, None]:
        """One choice token by token from the rollout daemon's generate_turn_stream (one call: one
        prefill, then each token as it is sampled, on a rank picked round-robin). Yields True once
        the call started (False when the role's engine cannot stream: nothing was sampled), then a
        one-token row per token, then {"final": the daemon's whole row}. Closing this generator
        (the client went away) cancels the call, which stops the daemon's sampling."""
        daemons = self.rollout.daemons
        rank = daemons[self.token_streams % len(daemons)].rank
        opts = {k: {"strings": list(v)} if k == "stop" else v for k, v in options.items() if k != "pieces"}
        call = self.rollout.generate_turn_stream.stream(rank, context, append, timeout_s=self.timeout_s, **opts)
        try:
            try:
                head = await anext(call)
            except RemoteError as exc:
                if exc.type_name == "NotImplementedError":
                    yield False
                    return
                raise _failed(exc, turn.kind) from exc
            except (DaemonGone, CallTimeout) as exc:
                raise _failed(exc, turn.kind) from exc
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
                raise _failed(exc, turn.kind) from exc
        finally:
            await call.aclose()  # a client gone mid-turn: the daemon stops sampling before its next token

    def _options(self, turn: TurnRequest, context: list[int], append: list[Any]) -> tuple[dict[str, Any], TurnBatcher]:
        """generate_turn's options for `turn`, and the batcher its size sends it to."""
        options = dict(turn.options)
        if turn.stream:
            options["pieces"] = True
        if turn.top_logprobs:
            options["top_logprobs"] = turn.top_logprobs
        if self.limits.max_prompt_tokens is not None:
            options["max_prompt_tokens"] = self.limits.max_prompt_tokens
        prompt_size = len(context) + sum(len(a) if isinstance(a, str) else len(json.dumps(a.get("messages", a))) for a in append)
        size = prompt_size + (0 if turn.options.get("fit_context") else turn.options["max_new_tokens"])
        return options, (self._long if size > self.limits.long_request_tokens else self.batcher)

    async def _generate(self, batcher: TurnBatcher, context: list[int], append: list[Any], options: dict[str, Any],
                        turn: TurnRequest) -> dict[str, Any]:
        try:
            return await batcher.request(context, append, options)
        except AgentGenerationError as exc:
            if exc.rows <= 1 or not isinstance(exc.__cause__, RemoteError):
                raise http_error(exc, turn.kind) from exc
            try:  # one bad row fails its whole batch: find out whether it was this one
                return await self._alone.request(context, append, options)
            except AgentGenerationError as alone:
                raise http_error(alone, turn.kind) from alone


def http_error(exc: AgentGenerationError, kind: str = "completion") -> ApiError:
    """400 when the rollout daemon refused the input (the field named), 503 when it is gone or
    timed out, else 500; the client hears no server paths, logs or tracebacks (the log has them)."""
    cause = exc.__cause__
    if isinstance(cause, RemoteError) and cause.type_name in INPUT_ERRORS:
        text = cause.message
        param = "stop" if "stop string" in text else "messages" if ("chat_template" in text or "chat template" in text) else None
        param = "top_logprobs" if "top_logprobs:" in text else param
        if param is None and ("prompt:" in text or "vocabulary" in text):
            param = "messages" if kind == "chat" else "prompt"
        text = text.split(": ", 1)[-1] if text.startswith("generate_turn row") else text
        text = text.split(": ", 1)[-1] if param and text.startswith(f"{param}: ") else text
        return BadRequest(param, f"the rollout daemon refused the request: {text}")
    incident = uuid.uuid4().hex[:12]
    get_logger(part="openai_server").warning("generation_failed", incident=incident, error=f"{type(cause).__name__}: {cause or exc}")
    if isinstance(cause, (DaemonGone, CallTimeout)):
        return ApiError(503, f"the rollout role is unavailable (incident {incident}; the server log has the details)")
    where = f"{cause.where} raised {cause.type_name}" if isinstance(cause, RemoteError) else type(cause).__name__
    return ApiError(500, f"generate_turn failed: {where} (incident {incident}; the server log has the details)")


def _failed(exc: Exception, kind: str) -> ApiError:
    """A failed stream call as the HTTP error a failed generate_turn call gets (http_error)."""
    error = AgentGenerationError(f"generate_turn_stream on the rollout role failed: {exc}")
    error.rows, error.__cause__ = 1, exc
    return http_error(error, kind)


def _streams(rollout: Any, name: str) -> bool:
    """Whether role group `rollout` declares `name` a streaming endpoint (any other object: no)."""
    endpoints = getattr(rollout, "endpoints", None)
    return isinstance(endpoints, dict) and bool((endpoints.get(name) or {}).get("stream")) and bool(getattr(rollout, "daemons", None))


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
                "weight_version": min(int(row["weight_version"]), int(step["weight_version"]))})
    return out


def api_key_from(key: str = "", key_file: str = "") -> str | None:
    """The API key to require: `key`, else the first line of `key_file`, else $HFRT_API_KEY, else
    None (no authentication). An empty key file is a ValueError."""
    import os
    from pathlib import Path

    if key:
        return key
    if key_file:
        lines = Path(key_file).read_text().strip().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"the API key file {key_file} is empty")
        return lines[0].strip()
    return os.environ.get("HFRT_API_KEY") or None


def serve_flow(*, host: str, port: int, model: str, start_timeout_s: float = 600.0, **options: Any) -> Any:
    """A flow (`async def flow(ctl, config)`) that serves the run's `rollout` role over HTTP until
    cancelled; `hfrt serve-openai` runs it with one local rollout daemon. `options` go to
    OpenAIServer (batch_size, flush_after_s, idle_flush, limits, api_key, tool_parser)."""

    async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        rollout = await ctl.role("rollout", timeout_s=start_timeout_s)
        async with OpenAIServer(rollout, host=host, port=port, model=model, **options) as server:
            print(f"hfrt serve-openai: serving {model!r} at {server.url} (Ctrl-C stops)", flush=True)
            try:
                await server.serve_forever()
            finally:
                print(f"hfrt serve-openai: stopping after {server.requests} requests, "
                      f"{server.generate_calls} generate_turn calls", flush=True)
        return {}

    return flow
