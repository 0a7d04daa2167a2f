"""The OpenAI-compatible request and response shapes of the rollout role's HTTP endpoint: a
/v1/completions or /v1/chat/completions body checked and turned into one generate_turn row plus its
sampling options, and a sampled turn turned back into OpenAI's JSON (with hfrt's token-in/token-out
extension fields `prompt_token_ids`, per-choice `token_ids`, `weight_version`).

Pure logic: it knows the OpenAI field names and generate_turn's row layout, nothing of HTTP
framing, batching, sessions or tokenizers (stop strings are checked for being one token on the
rollout daemon).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from hfrt.flows.agent.openai.http_json import HttpError

#: chat roles passed to the chat template
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(HttpError):
    """A request OpenAI would refuse: `param` names the field (OpenAI's error `param`)."""

    def __init__(self, param: str | None, message: str, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(status, f"{param}: {message}" if param else message)
        self.param, self.code = param, code


def error_body(exc: HttpError) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return {"error": {"message": exc.message, "type": kind, "param": getattr(exc, "param", None), "code": getattr(exc, "code", None)}}


@dataclass(frozen=True)
class TurnRequest:
    """One request as a generate_turn row: `context` ids and `append` items (a text or chat prompt),
    the sampling `options`, whether to return log-probs, and the text prompt (None for ids/chat)."""

    kind: str  # "completion" | "chat"
    model: str | None
    context: list[int]
    append: list[Any]
    options: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    text_prompt: str | None = None
    user: str | None = None
    stream: bool = False  # answer as server-sent events (one chunk: the turn is sampled whole)
    stream_usage: bool = False  # stream_options.include_usage


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(name, f"must be a number, not {value!r:.40}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise BadRequest(name, f"{value} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(name, f"must be an integer, not {value!r:.40}")
    if not lo <= value <= hi:
        raise BadRequest(name, f"{value} is out of range [{lo}, {hi}]")
    return value


def _refuse(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """400 when an OpenAI field we do not implement has a value other than its no-op ones."""
    if name in body and body[name] not in allowed:
        raise BadRequest(name, f"{body[name]!r:.40} is not supported: {why}")


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop", f"must be a string or a list of non-empty strings, not {value!r:.60}")
    return list(stops)


def _sampling(body: dict[str, Any], max_tokens: int, max_tokens_limit: int) -> dict[str, Any]:
    """The generate_turn options every request shares; refuses n > 1."""
    _refuse(body, "n", (None, 1), "one choice per request (send several requests; they are batched)")
    _refuse(body, "presence_penalty", (None, 0, 0.0), "no penalties")
    _refuse(body, "frequency_penalty", (None, 0, 0.0), "no penalties")
    _refuse(body, "logit_bias", (None, {}), "no logit bias")
    options: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "stop": _stop(body),
    }
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    if seed is not None:
        options["seed"] = seed
    if not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest("max_tokens", f"{max_tokens} is out of range [1, {max_tokens_limit}]")
    return options


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body must be a JSON object, not {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"must be a string, not {model!r:.40}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user", f"must be a string, not {user!r:.40}")
    return body


def _token_ids(value: list[Any], name: str) -> list[int]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise BadRequest(name, "a token-id prompt must be a non-empty list of non-negative integers")
    return [int(t) for t in value]


def _streaming(body: dict[str, Any]) -> dict[str, bool]:
    """TurnRequest's stream fields: `stream` (true/false) and stream_options.include_usage."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", f"must be true or false, not {stream!r:.40}")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("stream_options", f"must be {{\"include_usage\": true|false}}, not {options!r:.60}")
    return {"stream": bool(stream), "stream_usage": bool((options or {}).get("include_usage", False))}


def completion_request(body: Any, *, max_tokens_limit: int = 4096) -> TurnRequest:
    """A /v1/completions body: prompt is a string or token ids (or a list holding one of them)."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    _refuse(body, "echo", (None, False), "the prompt is returned as prompt_token_ids instead")
    _refuse(body, "best_of", (None, 1), "one sample per request")
    _refuse(body, "suffix", (None, ""), "no insertion")
    logprobs = _int(body, "logprobs", None, 0, 20)
    options = _sampling(body, _int(body, "max_tokens", 16, 1, 2**31) or 16, max_tokens_limit)
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "is empty")
        return TurnRequest("completion", body.get("model"), [], [prompt], options, logprobs is not None, prompt, body.get("user"), **_streaming(body))
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("prompt", f"holds {len(prompt)} prompts: send one prompt per request (concurrent requests are batched)")
    if isinstance(prompt, list):
        ids = _token_ids(prompt, "prompt")
        return TurnRequest("completion", body.get("model"), ids, [], options, logprobs is not None, None, body.get("user"), **_streaming(body))
    raise BadRequest("prompt", f"must be a string or a list of token ids, not {prompt!r:.60}")


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(where, f"must be an object with role and content, not {message!r:.60}")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise BadRequest(f"{where}.role", f"{role!r:.40} is not one of {', '.join(CHAT_ROLES)}")
    if message.get("tool_calls"):
        raise BadRequest(f"{where}.tool_calls", "structured tool calls are not supported: put the call in the content text")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"{where}.content", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
        content = "".join(p["text"] for p in content)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content", f"must be a string or a list of text parts, not {content!r:.60}")
    return {"role": role, "content": content}


def chat_request(body: Any, *, max_tokens_limit: int = 4096) -> TurnRequest:
    """A /v1/chat/completions body: the messages go to the rollout daemon's chat template."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", f"must be a non-empty list of messages, not {messages!r:.60}")
    chat = [_message(i, m) for i, m in enumerate(messages)]
    for name in ("tools", "functions"):
        _refuse(body, name, (None, []), "no structured tool calling: describe tools in a message and parse the reply text")
    _refuse(body, "tool_choice", (None, "none", "auto"), "no structured tool calling")
    _refuse(body, "response_format", (None, {"type": "text"}), "plain text responses only")
    _refuse(body, "top_logprobs", (None, 0), "only the sampled token's log-prob is returned")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs", f"must be true or false, not {logprobs!r:.40}")
    max_tokens = _int(body, "max_completion_tokens", None, 1, 2**31)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 16, 1, 2**31)
    options = _sampling(body, max_tokens or 16, max_tokens_limit)
    return TurnRequest("chat", body.get("model"), [], [chat], options, bool(logprobs), None, body.get("user"), **_streaming(body))


@dataclass(frozen=True)
class TurnResult:
    """What generate_turn sampled for one request: the whole prompt's ids, the sampled ids, their
    log-probs and text, and the weight version that sampled them."""

    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]
    text: str
    weight_version: int

    @classmethod
    def from_row(cls, context: list[int], row: dict[str, Any]) -> TurnResult:
        """From generate_turn's output row for a request whose `context` ids were sent."""
        prompt = list(context) + [int(t) for piece in row["appended"] for t in piece]
        return cls(prompt, [int(t) for t in row["turn_ids"]], [float(x) for x in row["turn_log_probs"]],
                   str(row["turn_text"]), int(row["weight_version"]))


def _finish_reason(request: TurnRequest, result: TurnResult) -> str:
    """'length' when the turn used all of max_tokens, else 'stop' (eos or a stop token)."""
    return "length" if len(result.token_ids) >= request.options["max_new_tokens"] else "stop"


def _head(kind: str, prefix: str, model: str, result: TurnResult) -> dict[str, Any]:
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()), "model": model,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        "prompt_token_ids": result.prompt_ids, "weight_version": result.weight_version,
    }


def token_name(token_id: int) -> str:
    """How a token is named in `logprobs` (the server has no tokenizer): `token_id:ID`."""
    return f"token_id:{token_id}"


def completion_body(request: TurnRequest, result: TurnResult, model: str) -> dict[str, Any]:
    """The /v1/completions response."""
    logprobs: dict[str, Any] | None = None
    if request.logprobs:
        logprobs = {"tokens": [token_name(t) for t in result.token_ids], "token_logprobs": result.log_probs,
                    "top_logprobs": None, "text_offset": None}
    choice = {"text": result.text, "index": 0, "finish_reason": _finish_reason(request, result), "logprobs": logprobs,
              "token_ids": result.token_ids}
    return {**_head("text_completion", "cmpl", model, result), "choices": [choice]}


def chat_body(request: TurnRequest, result: TurnResult, model: str) -> dict[str, Any]:
    """The /v1/chat/completions response."""
    logprobs: dict[str, Any] | None = None
    if request.logprobs:
        logprobs = {"content": [{"token": token_name(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(result.token_ids, result.log_probs, strict=True)]}
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
              "finish_reason": _finish_reason(request, result), "logprobs": logprobs, "token_ids": result.token_ids}
    return {**_head("chat.completion", "chatcmpl", model, result), "choices": [choice]}


def models_body(model: str, created: int) -> dict[str, Any]:
    """The /v1/models response: the one model this server samples from."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "hfrt"}]}


def event_stream(request: TurnRequest, body: dict[str, Any]) -> bytes:
    """A whole response as server-sent events, for clients that ask for `stream`: the turn is
    sampled at once, so the text comes in one chunk, then (chat) a chunk with finish_reason, then
    usage when stream_options.include_usage, then `data: [DONE]`."""
    head = {k: body[k] for k in ("id", "created", "model")}
    choice = body["choices"][0]
    extension = {"prompt_token_ids": body["prompt_token_ids"], "weight_version": body["weight_version"]}
    if request.kind == "chat":
        head["object"] = "chat.completion.chunk"
        delta = {"index": 0, "delta": choice["message"], "logprobs": choice["logprobs"], "finish_reason": None, "token_ids": choice["token_ids"]}
        end = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        chunks = [{**head, "choices": [delta], **extension}, {**head, "choices": [end]}]
    else:
        head["object"] = "text_completion"
        chunks = [{**head, "choices": [choice], **extension}]
    if request.stream_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    events = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(events).encode()
