"""An OpenAI-compatible HTTP endpoint on the rollout role, for external agent frameworks:
GET /v1/models, POST /v1/completions, POST /v1/chat/completions (tools, n, streaming, logprobs),
served by Starlette on uvicorn (hfrt.serve.app). Concurrent requests are batched into
generate_turn calls (hfrt.serve.rollout); responses carry the exact prompt and sampled token ids,
their log-probs and the weight version; requests with a session id (header X-Session-Id) are
recorded so `trajectory(session)` gives the Trajectory to train on; with `record` every
conversation served (a session when it ends, a request without one at once) is also written to a
folder (hfrt.serve.record) for training later.

Controller-side (no torch). It knows the request and response shapes and the sessions; nothing of
training, rewards or tokenizers (text and chats are tokenised on the rollout daemon).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.log import get_logger
from hfrt.serve.api import ApiError, BadRequest, Limits, TurnRequest, _message, chat_request, completion_request
from hfrt.serve.record import Recorder
from hfrt.serve.responses import (
    TurnResult,
    chat_body,
    completion_body,
    end_events,
    event_stream,
    stream_head,
    token_events,
)
from hfrt.serve.responses_api import Remembered, ResponseMemory, ResponsesTurn, responses_request
from hfrt.serve.responses_events import ResponseEvents, ResponseShape, text_logprobs
from hfrt.serve.rollout import RolloutClient, merge_rows
from hfrt.serve.sessions import Session, SessionCall, SessionStore
from hfrt.serve.stops import StopHoldback
from hfrt.serve.tools import parser_for
from hfrt.serve.turns import TURN_TIMEOUT_S, Trajectory, TurnBatcher


@dataclass(frozen=True)
class ServerLimits:
    """What the server accepts; a request past one gets a 4xx JSON error naming it.

    max_body_bytes: request body size (413). max_tokens: max_tokens / max_completion_tokens (400).
    max_n: choices per request (400). max_concurrent_requests: requests in progress at once (429).
    request_timeout_s: one request's wall time (408). header_timeout_s: a request's headers must
    arrive within this many seconds of its first byte (or of the connection opening), else the
    connection is answered 408 and closed; body_timeout_s: its body within this many seconds of
    its headers (408, connection closed). max_prompt_tokens: prompt length in tokens, checked on
    the rollout daemon (400; None: the model's context less max_tokens). Text more bytes than the
    model's context can hold is refused before it is sent to be tokenised (400).
    long_request_tokens: a request whose prompt (estimated from its size) plus max_tokens is longer
    goes to separate batches and is sampled `long_chunk_tokens` at a time (each chunk continues
    the exact ids so far), so a short request waits at most one chunk of a long one (a constrained
    turn, structured output or a forced call, is sampled in one call: a grammar cannot resume). A streamed
    turn is sampled token by token on the rollout daemon (generate_turn_stream: one prefill, a KV
    cache kept for the turn, each token sent as it is sampled) when `token_stream` is on and the
    role's engine can (the HF engine); otherwise stream_chunk_tokens per generate_turn call, each
    call's tokens sent as they come."""

    max_body_bytes: int = 16 << 20
    max_tokens: int = 4096
    max_n: int = 16
    max_concurrent_requests: int = 512
    request_timeout_s: float = 600.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_prompt_tokens: int | None = None
    long_request_tokens: int = 256
    long_chunk_tokens: int = 16
    stream_chunk_tokens: int = 4
    token_stream: bool = True


class OpenAIServer:
    """`async with OpenAIServer(rollout, model="tiny") as server:` serves on host:port (port 0:
    a free one; `server.url` is the base URL, e.g. http://127.0.0.1:PORT/v1).

    Batching: a generate_turn call goes out when `batch_size` requests wait or `flush_after_s`
    after the first (with `idle_flush`: at once when no call is in flight). Long requests (see
    ServerLimits.long_request_tokens) batch apart from short ones. A failed call is retried one
    request at a time, so one bad request cannot fail the others batched with it. `n` choices of
    a request are n rows of one call. A session (header X-Session-Id; the `user` field is the
    client's attribution only) records a call once it succeeded; with n > 1 choice i is recorded
    as session `NAME#i`. With `api_key`, every request needs `Authorization: Bearer <api_key>`
    (401 otherwise, before anything is generated). `replacing()` says whether recovery is
    replacing a dead rollout daemon now (503 with Retry-After while it is). With `record` (a
    folder) every conversation is written there as trajectories (hfrt.serve.record): a request
    without a session at once (each choice its own conversation), a session when it ends
    (`end_session`, POST /v1/sessions/ID/end), is dropped to make room, or the server stops; a
    reward given (`give_reward`) goes with it, or after it as a reward line."""

    def __init__(self, rollout: Any, *, host: str = "127.0.0.1", port: int = 0, model: str = "hfrt",
                 batch_size: int = 64, flush_after_s: float = 0.02, idle_flush: bool = False, limits: ServerLimits | None = None,
                 api_key: str | None = None, tool_parser: str = "hermes", max_sessions: int = 10_000,
                 timeout_s: float = TURN_TIMEOUT_S, replacing: Callable[[], bool] | None = None,
                 tool_template: str | None = None, record: str | Path | None = None) -> None:
        self.rollout, self.model, self.limits = rollout, model, limits or ServerLimits()
        self.tool_template = tool_template or None
        self.tool_parser = parser_for(tool_parser).name
        self.api_key = api_key or None
        self.client = RolloutClient(rollout, batch_size=batch_size, flush_after_s=flush_after_s, idle_flush=idle_flush,
                                    timeout_s=timeout_s, token_stream=self.limits.token_stream, replacing=replacing)
        self.recorder = Recorder(record, model=model) if record else None
        self.store = SessionStore(max_sessions, on_drop=self._write if self.recorder is not None else None)
        self._rewards: dict[str, float] = {}  # rewards given for sessions not yet written
        self.memory = ResponseMemory(max_sessions)  # responses by id, for previous_response_id
        self.requests = 0
        self.created = int(time.time())
        self.host, self.port = host, port
        self._http: Any = None
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def generate_calls(self) -> int:
        """generate_turn calls sent so far (batched rounds plus one-at-a-time retries)."""
        return self.client.calls

    @property
    def token_streams(self) -> int:
        """Streamed turns sampled token by token (the rest, in chunks)."""
        return self.client.token_streams

    @property
    def sessions(self) -> dict[str, Session]:
        return self.store.sessions

    @property
    def sessions_dropped(self) -> int:
        return self.store.dropped

    async def __aenter__(self) -> OpenAIServer:
        from hfrt.serve.app import HttpServer  # Starlette and uvicorn load with the server, not the API logic

        await self._check_template()
        self._http = HttpServer(self, self.host, self.port)
        self.port = await self._http.start()
        return self

    async def _check_template(self) -> None:
        """At start: a chat template that drops `tools` is said loudly (the model would never see
        its tools), and a built-in tool template the role does not know is refused."""
        info = await self.client.info()
        if self.tool_template is not None and info.tool_templates is not None and self.tool_template not in info.tool_templates:
            raise ValueError(f"tool template {self.tool_template!r} is not one the rollout role has: {info.tool_templates}")
        if info.template_sees_tools is False and self.tool_template is None:
            get_logger(part="openai_server").warning(
                "template_ignores_tools", model=self.model,
                message=f"the chat template of {self.model!r} ignores `tools`: requests' tool schemas never reach the model; "
                        f"serve it with a built-in tool template (--tool-template {', '.join(info.tool_templates or ['hermes'])})")

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self.recorder is not None:  # the sessions still open are conversations served too
            for name in list(self.store.sessions):
                self._write(name, self.store.pop(name))
            self.recorder.close()

    async def serve_forever(self) -> None:
        """Serve until cancelled (Ctrl-C in `hfrt serve-openai`)."""
        await asyncio.Event().wait()

    # -- sessions -------------------------------------------------------------------------

    def trajectory(self, session: str) -> Trajectory:
        """The session's calls as one Trajectory (gen_mask 1 exactly on sampled tokens); KeyError
        for an unknown session, SessionDrift when a call's prompt does not extend the previous ids."""
        return self.store.trajectory(session)

    def trajectories(self, session: str) -> list[Trajectory]:
        """The session as exact trajectories even when its client re-renders its history (an agent
        framework that rewrites earlier turns): a call that does not extend the previous one starts
        the next trajectory (see sessions.build_trajectories)."""
        return self.store.trajectories(session)

    def end_session(self, session: str, reward: float | None = None) -> Trajectory:
        """trajectory(session), then forget the session (sessions are kept until ended, at most
        max_sessions of them: the oldest is dropped to make room); recording, it is written with
        `reward` (or one given before)."""
        t = self.store.trajectory(session)
        if reward is not None:
            self._rewards[session] = float(reward)
        self._write(session, self.store.pop(session))
        return t

    def give_reward(self, session: str, reward: float) -> str:
        """A reward for `session`: kept for its trajectories while it is open ("pending"), else
        written after them as a reward line ("written"). Needs a recorder."""
        if self.recorder is None:
            raise ApiError(400, "this server records nothing: start it with --record DIR to give rewards", code="not_recording")
        if session in self.store.sessions:
            self._rewards[session] = float(reward)
            return "pending"
        self.recorder.reward(session, float(reward))
        return "written"

    def _write(self, name: str, session: Session) -> None:
        reward = self._rewards.pop(name, None)
        if self.recorder is not None:
            self.recorder.conversation(name, session, reward)

    def _record(self, name: str, turn: TurnRequest, result: TurnResult, message: dict[str, Any] | None) -> None:
        call = SessionCall(result.prompt_ids, result.token_ids, result.log_probs, result.weight_version)
        text = turn.text_prompt + result.text + result.stop_text if turn.text_prompt is not None else None  # as the ids spell it
        chat = None
        if message is not None:  # the reply as returned, in the form a client's echo of it is checked in
            chat = (turn.messages + [_message(len(turn.messages), message)], [t.schema for t in turn.tools])
        self.store.record(name, call, text=text, chat=chat, answer=message.get("content") if message is not None else result.text)

    def _continuation(self, turn: TurnRequest, name: str | None) -> tuple[list[int], list[Any]]:
        held = self.store.held(name)
        chat = turn.kind != "completion"
        return self.store.continuation(held, turn.context, turn.append, text_prompt=turn.text_prompt,
                                       messages=turn.messages if chat else None, tools=[t.schema for t in turn.tools],
                                       prefill=turn.prefill, template=turn.template)

    # -- requests -------------------------------------------------------------------------

    def completion_turn(self, body: Any) -> TurnRequest:
        return completion_request(body, limits=Limits(self.limits.max_tokens, self.limits.max_n))

    def chat_turn(self, body: Any) -> TurnRequest:
        return chat_request(body, limits=Limits(self.limits.max_tokens, self.limits.max_n), tool_parser=self.tool_parser,
                            template=self.tool_template)

    async def complete(self, turn: TurnRequest, session: str | None = None) -> tuple[list[TurnResult], dict[str, Any]]:
        """Sample `turn` (n choices), record it under `session`, and build the body."""
        results = await self.sample(turn, session)
        chat = turn.kind == "chat"
        body = chat_body(turn, results, self.model, self.tool_parser) if chat else completion_body(turn, results, self.model)
        for i, result in enumerate(results):  # recorded once sampled; with n > 1 choice i as NAME#i
            self._record_call(session if turn.n == 1 or not session else f"{session}#{i}", turn, result,
                              body["choices"][i]["message"] if chat else None)
        return results, body

    def _record_call(self, session: str | None, turn: TurnRequest, result: TurnResult, message: dict[str, Any] | None) -> None:
        """Record a sampled choice under `session`; without one, written at once as its own
        conversation when recording (else kept nowhere)."""
        if session:
            self._record(session, turn, result, message)
        elif self.recorder is not None:
            name = f"request-{uuid.uuid4().hex[:12]}"
            self._record(name, turn, result, message)
            self._write(name, self.store.pop(name))

    async def sample(self, turn: TurnRequest, name: str | None) -> list[TurnResult]:
        """The n choices of `turn`, continuing session `name`'s exact ids where the request extends them."""
        await self._check(turn)
        context, append = self._continuation(turn, name if turn.n == 1 or not name else f"{name}#0")
        options, batcher = self._options(turn, context, append)
        if batcher is self.client.long:
            chunk = self.limits.long_chunk_tokens
            rows = await asyncio.gather(*(self.client.chunked(context, append, options, turn.kind, chunk) for _ in range(turn.n)))
        else:
            rows = await asyncio.gather(*(self.client.generate(batcher, context, append, options, turn.kind) for _ in range(turn.n)))
        return [TurnResult.from_row(context, row) for row in rows]

    async def _check(self, turn: TurnRequest) -> None:
        """What is refused before anything is sent: another model's name (404), a role that
        cannot be called now (503), and text more bytes than the model's context can hold
        (400, before it is tokenised anywhere)."""
        if turn.model is not None and turn.model != self.model:
            raise BadRequest("model", f"{turn.model!r} does not exist: this server samples {self.model!r}", status=404, code="model_not_found")
        self.client.check_available()
        cap = (await self.client.info()).max_text_bytes
        size = turn.text_bytes
        if cap is not None and size > cap:
            info = await self.client.info()
            raise BadRequest("prompt" if turn.kind == "completion" else "messages" if turn.kind == "chat" else "input",
                             f"the text is {size} bytes, more than the model's context of {info.context_tokens} tokens can hold "
                             f"(no token spans more than {info.max_token_bytes} bytes, so at most {cap} bytes fit)",
                             code="context_length_exceeded")

    async def stream(self, turn: TurnRequest, session: str | None = None) -> AsyncIterator[bytes]:
        """`turn` as server-sent events sent as it is sampled: a chunk per token as the rollout daemon
        samples it (see parts), then the finish chunk (and usage); the session is recorded at the
        end. With n > 1 or tools the turn is sampled whole first (tool calls are parsed from the
        whole text), then sent a chunk per token."""
        if turn.n > 1 or turn.tools:
            results, body = await self.complete(turn, session)
            for event in event_stream(turn, results, body):
                yield event
            return
        head = stream_head(turn, self.model)
        async for part, first, end in self.parts(turn, session):
            for event in token_events(turn, head, part, first=first) if end is None else end_events(turn, head, end):
                yield event

    async def parts(self, turn: TurnRequest, session: str | None = None) -> AsyncIterator[tuple[TurnResult, bool, dict[str, Any] | None]]:
        """One choice of `turn` as it is sampled: (part, first, None) for each part — one token as
        the rollout daemon samples it (RolloutClient.token_steps), else one generate_turn call's
        tokens — whose text holds back what may become a stop string; then (the whole result,
        False, its response body) once, after the session was recorded."""
        await self._check(turn)
        context, append = self._continuation(turn, session)
        options, batcher = self._options(turn, context, append)
        row, sent = dict[str, Any](), ""
        holdback = StopHoldback(options.get("stop") or [], bool(options.get("include_stop_str_in_output")))
        async for step in await self._steps(turn, context, append, options, batcher):
            if "final" in step:  # the daemon's whole row: the same tokens, with turn_text and turn_finished
                row = step["final"]
                continue
            part = TurnResult.from_row(context if not row else [], step)
            pieces = part.pieces if len(part.pieces) == len(part.token_ids) else [part.text]
            shown = [holdback.feed(p) for p in pieces]  # stop text (or what may start one) is held back
            yield dataclasses.replace(part, pieces=shown if len(shown) == len(part.token_ids) else [], text="".join(shown)), not row, None
            sent += "".join(shown)
            row = merge_rows(row, step)
        result = TurnResult.from_row(context, row)
        rest = result.text[len(sent):] if result.text.startswith(sent) else ""
        if rest:  # text the last pieces held back (a character cut at the turn's end): a part without a token
            yield TurnResult([], [], [], rest, result.weight_version, [rest]), False, None
        body = chat_body(turn, [result], self.model, self.tool_parser) if turn.kind == "chat" else completion_body(turn, [result], self.model)
        self._record_call(session, turn, result, body["choices"][0]["message"] if turn.kind == "chat" else None)
        yield result, False, body

    # -- /v1/responses --------------------------------------------------------------------

    def responses_turn(self, body: Any) -> ResponsesTurn:
        return responses_request(body, limits=Limits(self.limits.max_tokens, self.limits.max_n), tool_parser=self.tool_parser,
                                 memory=self.memory, template=self.tool_template)

    async def respond(self, rt: ResponsesTurn, session: str | None = None) -> dict[str, Any]:
        """The Response object of `rt` (recorded under `session` as its chat turn is, and
        remembered for previous_response_id)."""
        results, body = await self.complete(rt.turn, session)
        return self._final(ResponseShape(rt, self.model, int(time.time())), rt, results[0], body)

    async def respond_stream(self, rt: ResponsesTurn, session: str | None = None) -> AsyncIterator[bytes]:
        """`rt` as Responses server-sent events: the text as it is sampled (with tools offered: the
        whole turn first, whose calls are parsed from its whole text), then every item's closing
        events and response.completed. The first events wait for the first token, so a request
        refused before it gets its JSON error rather than a stream."""
        shape = ResponseShape(rt, self.model, int(time.time()))
        events = ResponseEvents(shape)
        if rt.turn.tools:
            results, body = await self.complete(rt.turn, session)
            final = self._final(shape, rt, results[0], body)
            for event in (*events.start(), *events.finish(final)):
                yield event
            return
        started = False
        async for part, _, end in self.parts(rt.turn, session):
            out = [] if started else list(events.start())
            started = True
            if end is None and part.text:
                out += events.text_delta(part.text, text_logprobs(part) if rt.logprobs else [])
            elif end is not None:
                out += events.finish(self._final(shape, rt, part, end))
            for event in out:
                yield event

    def _final(self, shape: ResponseShape, rt: ResponsesTurn, result: TurnResult, body: dict[str, Any]) -> dict[str, Any]:
        """The whole Response from the chat body of its turn; remembered unless store is false."""
        choice = body["choices"][0]
        final = shape.final(result, choice["message"], choice["finish_reason"])
        if rt.echo.get("store", True) is not False:
            self.memory.remember(final["id"], Remembered(rt.messages + [choice["message"]], rt.tools))
        return final

    async def _steps(self, turn: TurnRequest, context: list[int], append: list[Any], options: dict[str, Any],
                     batcher: TurnBatcher) -> AsyncIterator[dict[str, Any]]:
        """A streamed turn's rows as they come: token by token where the role can, else in chunks
        (a constrained turn in one: its grammar cannot resume on a later call)."""
        if self.client.can_stream:
            tokens = self.client.token_steps(context, append, options, turn.kind)
            if await anext(tokens):
                return tokens
            await tokens.aclose()  # the role cannot stream token by token: chunks from now on
        chunk = self.limits.stream_chunk_tokens if "json_schema" not in options else int(options["max_new_tokens"])  # see _options
        return self.client.chunks(batcher, context, append, options, turn.kind, chunk)

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
        # a constrained turn is sampled in one call: a grammar cannot resume in the middle of a turn on the next call
        long = size > self.limits.long_request_tokens and "json_schema" not in options
        return options, (self.client.long if long else self.client.batcher)
