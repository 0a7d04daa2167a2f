"""The OpenAI-compatible requests of the rollout role's HTTP endpoint: a /v1/completions or
/v1/chat/completions body checked field by field (each refusal names its field, OpenAI's error
`param`) and turned into a TurnRequest: one generate_turn row (context ids, append items), its
sampling options, `n`, log-prob and streaming wishes, and the tools offered.

Pure logic: it knows the OpenAI field names and generate_turn's row layout, nothing of HTTP,
batching, sessions or tokenizers (token ids are checked against the vocabulary and prompts
against the context on the rollout daemon).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from hfrt.serve.errors import ApiError, BadRequest
from hfrt.serve.structured import call_schema, response_format
from hfrt.serve.tools import Tool, check_tool_choice, check_tools, parser_for

#: chat roles passed to the chat template
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: deepest JSON nesting accepted in a body (OpenAI bodies need a handful of levels; tool schemas a few more)
MAX_DEPTH = 64
#: largest token id a prompt may hold before the rollout daemon checks it against its vocabulary
MAX_TOKEN_ID = 2**31 - 1


def error_body(exc: ApiError) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}


def parse_body(raw: bytes) -> Any:
    """The body as JSON: 400 when it is empty, not UTF-8 JSON, nested deeper than MAX_DEPTH, or
    holds a string that is not valid Unicode (a lone surrogate) — the latter naming the field."""
    if not raw:
        raise BadRequest(None, "the request has no body: send a JSON object with Content-Type: application/json")
    try:
        body = json.loads(raw)
    except RecursionError as exc:
        raise BadRequest(None, f"the body is nested deeper than {MAX_DEPTH} levels") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(None, f"the body is not valid JSON: {exc}") from exc
    _check_tree(body)
    return body


def _check_tree(body: Any) -> None:
    """Depth and Unicode of every value, iteratively (no recursion on hostile input)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRequest(None, f"the body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise BadRequest(where or None, "holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text") from exc
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, where or "body", depth + 1))
                stack.append((v, f"{where}.{k}" if where else str(k), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


@dataclass(frozen=True)
class TurnRequest:
    """One request as a generate_turn row: `context` ids and `append` items (a text, a chat
    {"messages", "tools"} or a prefill text), the sampling `options`, `n` choices, log-probs
    (`top_logprobs` alternatives each), streaming, and for chat the checked `messages`, the
    `tools` offered and the `tool_choice`."""

    kind: str  # "completion" | "chat"
    model: str | None
    context: list[int]
    append: list[Any]
    options: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    text_prompt: str | None = None
    user: str | None = None  # attribution only: sessions are keyed by the X-Session-Id header
    stream: bool = False
    stream_usage: bool = False  # stream_options.include_usage
    n: int = 1
    top_logprobs: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | None = None  # "auto" | "none" | "required" | a function's name; None without tools
    prefill: str = ""  # text put after the generation prompt so a required call opens (tool_choice)
    template: str | None = None  # a built-in chat template the rollout daemon renders with (None: the tokenizer's)

    @property
    def text_bytes(self) -> int:
        """UTF-8 bytes of the request's own text (its text prompt, or its messages' contents): the
        prompt is at least this many bytes whatever a template adds."""
        if self.text_prompt is not None:
            return len(self.text_prompt.encode("utf-8", "surrogatepass"))
        return sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in self.messages if isinstance(m.get("content"), str))


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False,
            param: str | None = None) -> float:
    value, param = body.get(name), param or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(param, f"must be a number, not {value!r:.40}")
    if not math.isfinite(value):
        raise BadRequest(param, f"must be a finite number, not {value}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise BadRequest(param, f"{value} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
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


#: most stop strings a request may send, and the longest one (characters)
MAX_STOPS, MAX_STOP_CHARS = 16, 512
#: most logit_bias entries a request may send, and the range of each value (OpenAI's)
MAX_BIAS_ENTRIES, MAX_BIAS = 1024, 100.0


def _stop(body: dict[str, Any]) -> list[str]:
    """`stop`: a string or a list of strings of any length (text-level on the rollout daemon)."""
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop", f"must be a string or a list of non-empty strings, not {value!r:.60}")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each")
    return list(stops)


def _logit_bias(body: dict[str, Any]) -> dict[str, float]:
    """`logit_bias`: {token id (a string of digits): value in [-100, 100]}; the rollout daemon checks
    the ids against its vocabulary."""
    value = body.get("logit_bias")
    if value is None or value == {}:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_BIAS_ENTRIES:
        raise BadRequest("logit_bias", f"must be an object of at most {MAX_BIAS_ENTRIES} {{\"token id\": bias}} entries, not {value!r:.60}")
    out: dict[str, float] = {}
    for key in value:
        if not (isinstance(key, str) and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise BadRequest("logit_bias", f"{key!r:.40} is not a token id (a string of digits)")
        out[str(int(key))] = _number(value, key, 0.0, -MAX_BIAS, MAX_BIAS, param=f"logit_bias.{key}")
    return out


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: max_tokens (and max_completion_tokens) and n."""

    max_tokens: int = 4096
    max_n: int = 16


def _sampling(body: dict[str, Any], max_tokens: int, limits: Limits) -> dict[str, Any]:
    """The generate_turn options every request shares (penalties, bias and stop strings only when set)."""
    options: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "stop": _stop(body),
    }
    for name in ("presence_penalty", "frequency_penalty"):
        if penalty := _number(body, name, 0.0, -2.0, 2.0):
            options[name] = penalty
    if bias := _logit_bias(body):
        options["logit_bias"] = bias
    include = body.get("include_stop_str_in_output")
    if include is not None and not isinstance(include, bool):
        raise BadRequest("include_stop_str_in_output", f"must be true or false, not {include!r:.40}")
    if include:
        options["include_stop_str_in_output"] = True
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    if seed is not None:
        options["seed"] = seed
    top_k = _int(body, "top_k", None, -1, 2**31)  # vLLM's extension: sample among the k most likely (-1, 0: all)
    if top_k is not None and top_k > 0:
        options["top_k"] = top_k
    if not 1 <= max_tokens <= limits.max_tokens:
        raise BadRequest("max_tokens", f"{max_tokens} is out of range [1, {limits.max_tokens}] (the server's max_tokens limit)")
    return options


def _common(body: Any, limits: Limits) -> tuple[dict[str, Any], dict[str, Any]]:
    """The body as an object, and the TurnRequest fields every endpoint shares."""
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body must be a JSON object, not {type(body).__name__}")
    for name in ("model", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(name, f"must be a string, not {body[name]!r:.40}")
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", f"must be true or false, not {stream!r:.40}")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("stream_options", f"must be {{\"include_usage\": true|false}}, not {options!r:.60}")
    n = _int(body, "n", 1, 1, limits.max_n) or 1
    return body, {"model": body.get("model"), "user": body.get("user"), "stream": bool(stream), "n": n,
                  "stream_usage": bool((options or {}).get("include_usage", False))}


def _token_ids(value: list[Any], name: str) -> list[int]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise BadRequest(name, f"a token-id prompt must be a non-empty list of integers in [0, {MAX_TOKEN_ID}]")
    return [int(t) for t in value]


def completion_request(body: Any, *, limits: Limits = Limits()) -> TurnRequest:
    """A /v1/completions body: prompt is a string or token ids (or a list holding one of them)."""
    body, common = _common(body, limits)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    _refuse(body, "echo", (None, False), "the prompt is returned as prompt_token_ids instead")
    _refuse(body, "best_of", (None, 1), "use n for several samples")
    _refuse(body, "suffix", (None, ""), "no insertion")
    logprobs = _int(body, "logprobs", None, 0, 20)
    options = _sampling(body, _int(body, "max_tokens", 16, 1, 2**31) or 16, limits)
    shared = {**common, "options": options, "logprobs": logprobs is not None, "top_logprobs": logprobs or 0}
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "is empty")
        return TurnRequest("completion", context=[], append=[prompt], text_prompt=prompt, **shared)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("prompt", f"holds {len(prompt)} prompts: send one prompt per request (concurrent requests are batched)")
    if isinstance(prompt, list):
        return TurnRequest("completion", context=_token_ids(prompt, "prompt"), append=[], **shared)
    raise BadRequest("prompt", f"must be a string or a list of token ids, not {prompt!r:.60}")


def _text(content: Any, where: str) -> str:
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest(where, "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest(where, f"must be a string or a list of text parts, not {content!r:.60}")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, with arguments as an object where they parse (what chat
    templates render)."""
    if not isinstance(calls, list):
        raise BadRequest(where, f"must be a list of tool calls, not {calls!r:.60}")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
            raise BadRequest(f"{where}[{i}]", "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\": a JSON string}}")
        try:
            arguments: Any = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            arguments = fn.get("arguments")
        out.append({"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(where, f"must be an object with role and content, not {message!r:.60}")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise BadRequest(f"{where}.role", f"{role!r:.40} is not one of {', '.join(CHAT_ROLES)}")
    out: dict[str, Any] = {"role": role}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    elif message.get("tool_calls"):
        raise BadRequest(f"{where}.tool_calls", f"only assistant messages carry tool calls, not {role} ones")
    out["content"] = "" if content is None and role == "assistant" else _text(content, f"{where}.content")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise BadRequest(f"{where}.tool_call_id", "a tool message must name the call it answers (a string tool_call_id)")
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str) and role in ("tool", "user", "system"):
        out["name"] = message["name"]
    return out


def chat_request(body: Any, *, limits: Limits = Limits(), tool_parser: str = "hermes", template: str | None = None) -> TurnRequest:
    """A /v1/chat/completions body: the messages (and tools) go to the rollout daemon's chat template
    (or the built-in one `template` names)."""
    body, common = _common(body, limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", f"must be a non-empty list of messages, not {messages!r:.60}")
    chat = [_message(i, m) for i, m in enumerate(messages)]
    _refuse(body, "functions", (None, []), "use tools")
    _refuse(body, "function_call", (None, "none", "auto"), "use tool_choice")
    _refuse(body, "modalities", (None, ["text"]), "text out only")
    _refuse(body, "audio", (None,), "text out only")
    _refuse(body, "web_search_options", (None,), "no hosted web search")
    fmt = response_format(body)
    tools = check_tools(body.get("tools"))
    choice = check_tool_choice(body.get("tool_choice"), tools)
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise BadRequest("parallel_tool_calls", f"must be true or false, not {body['parallel_tool_calls']!r:.40}")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs", f"must be true or false, not {logprobs!r:.40}")
    top = _int(body, "top_logprobs", 0, 0, 20) or 0
    if top and not logprobs:
        raise BadRequest("top_logprobs", "needs \"logprobs\": true")
    max_tokens = _int(body, "max_completion_tokens", None, 1, 2**31)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", None, 1, 2**31)
    options = _sampling(body, max_tokens or limits.max_tokens, limits)
    if max_tokens is None:  # OpenAI's chat default: as long as the context allows (fitted on the rollout daemon)
        options["fit_context"] = True
    offered = tools if choice != "none" else []
    parser, prefill = parser_for(tool_parser), ""
    if offered and choice != "auto":  # a forced call: its JSON sampled under its schema, after the parser's opening
        prefill = parser.opening
        options["json_schema"] = call_schema(offered, choice, parser.arguments_key)
    elif fmt is not None:
        options["json_schema"] = fmt
    item: dict[str, Any] = {"messages": chat, "tools": [t.schema for t in offered] or None, **({"template": template} if template else {})}
    return TurnRequest("chat", context=[], append=[item, prefill] if prefill else [item], options=options, logprobs=bool(logprobs),
                       top_logprobs=top, messages=chat, tools=offered, tool_choice=choice if tools else None, prefill=prefill,
                       template=template, **common)
