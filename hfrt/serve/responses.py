"""The OpenAI-compatible responses of the rollout role's HTTP endpoint: sampled turns turned into
/v1/completions and /v1/chat/completions JSON (tool calls parsed out of chat text), or into
server-sent events token by token, with hfrt's token-in/token-out extension fields
(`prompt_token_ids`, per-choice `token_ids`, `weight_version`).

Pure logic: it knows OpenAI's response shapes and generate_turn's output row, nothing of HTTP,
batching or sessions. Tokens are named `token_id:ID` in `logprobs` (exact; the server holds no
tokenizer); streamed text pieces come decoded from the rollout daemon.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hfrt.serve.api import TurnRequest
from hfrt.serve.tools import parser_for


@dataclass(frozen=True)
class TurnResult:
    """What generate_turn sampled for one choice: the whole prompt's ids, the sampled ids, their
    log-probs and text, the weight version, (when asked) each token's text piece and its top
    alternatives [(id, log-prob), ...], `finished`: whether the turn ended on eos, a stop token or
    a stop string (False: cut at max_tokens or by the model's context; None: the role did not say),
    and `stop_text`: the text the ids spell past `text` when a stop string ended it."""

    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]
    text: str
    weight_version: int
    pieces: list[str] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool | None = None
    stop_text: str = ""  # what the ids spell past `text` when a stop string ended the turn

    @classmethod
    def from_row(cls, context: list[int], row: dict[str, Any]) -> TurnResult:
        """From generate_turn's output row for a request whose `context` ids were sent."""
        prompt = list(context) + [int(t) for piece in row["appended"] for t in piece]
        top = [[(int(i), float(lp)) for i, lp in alts] for alts in row.get("turn_top") or []]
        finished = row.get("turn_finished")
        return cls(prompt, [int(t) for t in row["turn_ids"]], [float(x) for x in row["turn_log_probs"]],
                   str(row["turn_text"]), int(row["weight_version"]), [str(p) for p in row.get("turn_pieces") or []], top,
                   None if finished is None else bool(finished), str(row.get("turn_stop_text") or ""))


def token_name(token_id: int) -> str:
    """How a token is named in `logprobs` (the server has no tokenizer): `token_id:ID`."""
    return f"token_id:{token_id}"


def _finish_reason(request: TurnRequest, result: TurnResult) -> str:
    """'length' when the turn was cut before eos or a stop token — by max_tokens, or by the model's
    context (a chat request without max_tokens gets what the context leaves) — else 'stop'."""
    if result.finished is not None:
        return "stop" if result.finished else "length"
    return "length" if len(result.token_ids) >= request.options["max_new_tokens"] else "stop"


def _head(kind: str, prefix: str, model: str, results: list[TurnResult]) -> dict[str, Any]:
    n_prompt, n_out = len(results[0].prompt_ids), sum(len(r.token_ids) for r in results)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()), "model": model,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        "prompt_token_ids": results[0].prompt_ids, "weight_version": results[0].weight_version,
    }


def _top(result: TurnResult, i: int) -> list[tuple[int, float]]:
    return result.top[i] if i < len(result.top) else []


def completion_body(request: TurnRequest, results: list[TurnResult], model: str) -> dict[str, Any]:
    """The /v1/completions response, one choice per result."""
    choices = []
    for index, result in enumerate(results):
        logprobs: dict[str, Any] | None = None
        if request.logprobs:
            logprobs = {"tokens": [token_name(t) for t in result.token_ids], "token_logprobs": result.log_probs,
                        "top_logprobs": [{token_name(t): lp for t, lp in _top(result, i)} for i in range(len(result.token_ids))]
                        if request.top_logprobs else None, "text_offset": None}
        choices.append({"text": result.text, "index": index, "finish_reason": _finish_reason(request, result), "logprobs": logprobs,
                        "token_ids": result.token_ids})
    return {**_head("text_completion", "cmpl", model, results), "choices": choices}


def _chat_logprobs(request: TurnRequest, result: TurnResult, start: int = 0, stop: int | None = None) -> dict[str, Any] | None:
    if not request.logprobs:
        return None
    ids = result.token_ids[start:stop]
    return {"content": [{"token": token_name(t), "logprob": result.log_probs[start + i], "bytes": None,
                         "top_logprobs": [{"token": token_name(a), "logprob": lp, "bytes": None} for a, lp in _top(result, start + i)]}
                        for i, t in enumerate(ids)]}


def assistant_message(request: TurnRequest, result: TurnResult, tool_parser: str) -> dict[str, Any]:
    """The reply as an OpenAI assistant message: with tools offered, calls parsed out of the
    prefill + sampled text (text that holds none stays the content)."""
    if not request.tools:
        return {"role": "assistant", "content": result.text}
    content, calls = parser_for(tool_parser).parse(request.prefill + result.text, request.tools)
    if not calls:
        return {"role": "assistant", "content": result.text}
    return {"role": "assistant", "content": content, "tool_calls": calls}


def chat_body(request: TurnRequest, results: list[TurnResult], model: str, tool_parser: str = "hermes") -> dict[str, Any]:
    """The /v1/chat/completions response, one choice per result."""
    choices = []
    for index, result in enumerate(results):
        message = assistant_message(request, result, tool_parser)
        reason = "tool_calls" if message.get("tool_calls") else _finish_reason(request, result)
        choices.append({"index": index, "message": message, "finish_reason": reason, "logprobs": _chat_logprobs(request, result),
                        "token_ids": result.token_ids})
    return {**_head("chat.completion", "chatcmpl", model, results), "choices": choices}


def models_body(model: str, created: int) -> dict[str, Any]:
    """The /v1/models response: the one model this server samples from."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "hfrt"}]}


def _event(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def event_stream(request: TurnRequest, results: list[TurnResult], body: dict[str, Any]) -> Iterator[bytes]:
    """The response as server-sent events: per choice a chunk per sampled token (its text piece,
    id and log-prob; parsed tool calls as one chunk), a chunk with finish_reason, then usage when
    stream_options.include_usage, then `data: [DONE]`. The first chunk also carries
    prompt_token_ids and weight_version."""
    head = {k: body[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    first = True
    for index, (result, choice) in enumerate(zip(results, body["choices"], strict=True)):
        extension = {"prompt_token_ids": body["prompt_token_ids"], "weight_version": body["weight_version"]} if first else {}
        first = False
        for delta in _deltas(request, result, choice, index):
            yield _event({**head, "choices": [delta], **extension})
            extension = {}
        end: dict[str, Any] = {"index": index, "finish_reason": choice["finish_reason"], "logprobs": None}
        if request.kind == "chat":
            end["delta"] = {}
        else:
            end["text"] = ""
        yield _event({**head, "choices": [end]})
    if request.stream_usage:
        yield _event({**head, "choices": [], "usage": body["usage"]})
    yield b"data: [DONE]\n\n"


def stream_head(request: TurnRequest, model: str) -> dict[str, Any]:
    """The fields every chunk of one streamed response shares."""
    prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model,
            "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion"}


def token_events(request: TurnRequest, head: dict[str, Any], part: TurnResult, *, first: bool) -> Iterator[bytes]:
    """Chunks for the tokens of `part` as they are sampled (a streamed turn's next tokens); the
    `first` part opens with the role (chat) and carries prompt_token_ids and weight_version."""
    extension = {"prompt_token_ids": part.prompt_ids, "weight_version": part.weight_version} if first else {}
    for delta in _deltas(request, part, {"message": {}}, 0, role=first):
        yield _event({**head, "choices": [delta], **extension})
        extension = {}


def end_events(request: TurnRequest, head: dict[str, Any], body: dict[str, Any]) -> Iterator[bytes]:
    """A streamed turn's closing chunks: finish_reason, usage when asked, [DONE]."""
    end: dict[str, Any] = {"index": 0, "finish_reason": body["choices"][0]["finish_reason"], "logprobs": None}
    if request.kind == "chat":
        end["delta"] = {}
    else:
        end["text"] = ""
    yield _event({**head, "choices": [end]})
    if request.stream_usage:
        yield _event({**head, "choices": [], "usage": body["usage"]})
    yield b"data: [DONE]\n\n"


def _deltas(request: TurnRequest, result: TurnResult, choice: dict[str, Any], index: int, *, role: bool = True) -> Iterator[dict[str, Any]]:
    """One choice's chunks before its finish chunk."""
    chat = request.kind == "chat"
    if chat and role:
        yield {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    if chat:
        calls = choice["message"].get("tool_calls")
        if calls:
            content = choice["message"].get("content")
            delta = {"content": content} if content else {}
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            yield {"index": index, "delta": delta, "logprobs": _chat_logprobs(request, result), "finish_reason": None,
                   "token_ids": result.token_ids}
            return
    pieces = clip_pieces(result.pieces, result.text) if len(result.pieces) == len(result.token_ids) else [result.text]
    for i, piece in enumerate(pieces):
        ids = result.token_ids[i:i + 1] if len(pieces) == len(result.token_ids) else result.token_ids
        if chat:
            yield {"index": index, "delta": {"content": piece}, "finish_reason": None, "token_ids": ids,
                   "logprobs": _chat_logprobs(request, result, i, i + len(ids))}
        else:
            logprobs = {"tokens": [token_name(t) for t in ids], "token_logprobs": result.log_probs[i:i + len(ids)],
                        "top_logprobs": None, "text_offset": None} if request.logprobs else None
            yield {"index": index, "text": piece, "finish_reason": None, "logprobs": logprobs, "token_ids": ids}


def clip_pieces(pieces: list[str], text: str) -> list[str]:
    """Token pieces cut to the returned `text` (the sampled ids may spell a stop string past it):
    the pieces' text stops where `text` does, and what the pieces lack of it joins the last one."""
    out, used = [], 0
    for piece in pieces:
        take = piece[:max(0, len(text) - used)]
        out.append(take)
        used += len(take)
    if out and used < len(text):
        out[-1] += text[used:]
    return out
