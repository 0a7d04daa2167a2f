"""An OpenAI-compatible HTTP endpoint on the rollout role, for external agent frameworks:
GET /v1/models, POST /v1/completions, POST /v1/chat/completions. Concurrent requests are batched
into generate_turn calls (TurnBatcher); responses carry the exact prompt and sampled token ids,
their log-probs and the weight version; requests with a session id (header X-Session-Id, or the
`user` field) are recorded so `trajectory(session)` gives the Trajectory to train on.

Controller-side (no torch). It knows the rollout role's generate_turn endpoint; nothing of
training, rewards or tokenizers (text is tokenised on the rollout daemon).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hfrt.flows.agent.loop import AgentGenerationError, Trajectory, TurnBatcher
from hfrt.flows.agent.openai.api import (
    BadRequest,
    TurnRequest,
    TurnResult,
    chat_body,
    chat_request,
    completion_body,
    completion_request,
    error_body,
    event_stream,
    models_body,
)
from hfrt.flows.agent.openai.http_json import HttpError, JsonHttpServer, Request, Response
from hfrt.flows.agent.openai.sessions import Session, SessionCall, build_trajectory
from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.log import get_logger
from hfrt.wire.errors import CallTimeout, DaemonGone, RemoteError

#: remote error types that mean the request's input was refused (a 400, not a server fault)
INPUT_ERRORS = ("ValueError", "TypeError", "KeyError")


class OpenAIServer:
    """`async with OpenAIServer(rollout, model="tiny") as server:` serves on host:port (port 0:
    a free one; `server.url` is the base URL, e.g. http://127.0.0.1:PORT/v1).

    Batching: a generate_turn call goes out when `batch_size` requests wait or `flush_after_s`
    after the first (with `idle_flush`: at once when no call is in flight, so a lone client never
    waits, while requests that come during a call go together in the next). A failed call is
    retried one request at a time, so one bad request cannot fail the others batched with it.
    Calls reach the rollout daemon in the order they are sent; responses on one connection come
    back in request order. A session records a call once it succeeded."""

    def __init__(self, rollout: Any, *, host: str = "127.0.0.1", port: int = 0, model: str = "hfrt",
                 batch_size: int = 64, flush_after_s: float = 0.02, idle_flush: bool = False,
                 max_tokens_limit: int = 4096, max_sessions: int = 10_000, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.rollout, self.model, self.max_tokens_limit = rollout, model, max_tokens_limit
        self.batcher = TurnBatcher(rollout, flush_after_s=flush_after_s, timeout_s=timeout_s, batch_size=batch_size, idle_flush=idle_flush)
        self._alone = TurnBatcher(rollout, flush_after_s=0.0, timeout_s=timeout_s, batch_size=1)
        self.http = JsonHttpServer(self.handle, error_body, host=host, port=port)
        self.sessions: dict[str, Session] = {}
        self.max_sessions, self.sessions_dropped = max_sessions, 0
        self.requests = 0
        self.created = int(time.time())

    @property
    def url(self) -> str:
        return f"http://{self.http.host}:{self.http.port}/v1"

    @property
    def generate_calls(self) -> int:
        """generate_turn calls sent so far (batched rounds plus one-at-a-time retries)."""
        return self.batcher.calls + self._alone.calls

    async def __aenter__(self) -> OpenAIServer:
        await self.http.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()

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

    def end_session(self, session: str) -> Trajectory:
        """trajectory(session), then forget the session (sessions are kept until ended, at most
        max_sessions of them: the oldest is dropped to make room)."""
        t = self.trajectory(session)
        del self.sessions[session]
        return t

    # -- HTTP -----------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        routes = {("GET", "/v1/models"): self._models, ("POST", "/v1/completions"): self._completions,
                  ("POST", "/v1/chat/completions"): self._chat}
        route = routes.get((request.method, request.path.rstrip("/") or "/"))
        if route is None:
            if any(path == request.path.rstrip("/") for _, path in routes):
                raise HttpError(405, f"{request.method} is not allowed on {request.path}")
            raise HttpError(404, f"no route {request.method} {request.path}: serving /v1/models, /v1/completions, /v1/chat/completions")
        self.requests += 1
        return await route(request)

    async def _models(self, request: Request) -> Response:
        return Response(200, models_body(self.model, self.created))

    async def _completions(self, request: Request) -> Response:
        turn = completion_request(request.json(), max_tokens_limit=self.max_tokens_limit)
        return _reply(turn, completion_body(turn, await self._sample(turn, request), self.model))

    async def _chat(self, request: Request) -> Response:
        turn = chat_request(request.json(), max_tokens_limit=self.max_tokens_limit)
        return _reply(turn, chat_body(turn, await self._sample(turn, request), self.model))

    # -- sampling -------------------------------------------------------------------------

    async def _sample(self, turn: TurnRequest, request: Request) -> TurnResult:
        if turn.model is not None and turn.model != self.model:
            raise BadRequest("model", f"{turn.model!r} does not exist: this server samples {self.model!r}", status=404, code="model_not_found")
        name = request.headers.get("x-session-id") or turn.user
        context, append = self._continuation(turn, self.sessions.get(name) if name else None)
        result = await self._generate(context, append, turn.options)
        if name:
            session = self._session(name)
            session.calls.append(SessionCall(result.prompt_ids, result.token_ids, result.log_probs, result.weight_version))
            session.text = turn.text_prompt + result.text if turn.text_prompt is not None else None
        return result

    def _session(self, name: str) -> Session:
        """The named session, made on first use; past max_sessions the oldest is dropped (logged)."""
        if name not in self.sessions and len(self.sessions) >= self.max_sessions:
            oldest = next(iter(self.sessions))
            del self.sessions[oldest]
            self.sessions_dropped += 1
            get_logger(part="openai_server").warning("session_dropped", session=oldest, max_sessions=self.max_sessions)
        return self.sessions.setdefault(name, Session())

    @staticmethod
    def _continuation(turn: TurnRequest, session: Session | None) -> tuple[list[int], list[Any]]:
        """A text prompt that starts with the session's last prompt text + output text continues
        the session's exact ids (only the new text is tokenised): no re-tokenisation drift."""
        if session is None or session.text is None or turn.text_prompt is None or not turn.text_prompt.startswith(session.text):
            return turn.context, turn.append
        rest = turn.text_prompt[len(session.text):]
        return session.ids, [rest] if rest else []

    async def _generate(self, context: list[int], append: list[Any], options: dict[str, Any]) -> TurnResult:
        try:
            row = await self.batcher.request(context, append, options)
        except AgentGenerationError as exc:
            if exc.rows <= 1 or not isinstance(exc.__cause__, RemoteError):
                raise _http_error(exc) from exc
            try:  # one bad row fails its whole batch: find out whether it was this one
                row = await self._alone.request(context, append, options)
            except AgentGenerationError as alone:
                raise _http_error(alone) from alone
        return TurnResult.from_row(context, row)


def _reply(turn: TurnRequest, body: dict[str, Any]) -> Response:
    if turn.stream:
        return Response(200, event_stream(turn, body), {"Cache-Control": "no-cache"}, content_type="text/event-stream")
    return Response(200, body)


def _http_error(exc: AgentGenerationError) -> HttpError:
    """400 when the rollout daemon refused the input, 503 when it is gone or timed out, else 500."""
    cause = exc.__cause__
    if isinstance(cause, RemoteError) and cause.type_name in INPUT_ERRORS:
        param = "stop" if "stop string" in cause.message else ("messages" if "chat_template" in cause.message else None)
        return BadRequest(param, f"the rollout daemon refused the request: {cause.message}")
    if isinstance(cause, (DaemonGone, CallTimeout)):
        return HttpError(503, f"the rollout role is unavailable: {cause}")
    if isinstance(cause, RemoteError):  # without the remote traceback (the daemon's log has it)
        return HttpError(500, f"generate_turn failed: {cause.where} raised {cause.type_name}: {cause.message}")
    return HttpError(500, f"generate_turn failed: {cause or exc}")


def serve_flow(*, host: str, port: int, model: str, batch_size: int = 64, flush_after_s: float = 0.02,
               idle_flush: bool = False, start_timeout_s: float = 600.0) -> Any:
    """A flow (`async def flow(ctl, config)`) that serves the run's `rollout` role over HTTP until
    cancelled; `hfrt serve-openai` runs it with one local rollout daemon."""

    async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        rollout = await ctl.role("rollout", timeout_s=start_timeout_s)
        async with OpenAIServer(rollout, host=host, port=port, model=model, batch_size=batch_size, flush_after_s=flush_after_s,
                                idle_flush=idle_flush) as server:
            print(f"hfrt serve-openai: serving {model!r} at {server.url} (Ctrl-C stops)", flush=True)
            try:
                await server.serve_forever()
            finally:
                print(f"hfrt serve-openai: stopping after {server.requests} requests, "
                      f"{server.generate_calls} generate_turn calls", flush=True)
        return {}

    return flow
