"""The request side of `POST /v1/responses`: a Responses body (text or item `input`,
`instructions`, function `tools`, `function_call` / `function_call_output` items, `tool_choice`,
`max_output_tokens`, `text.format`, `previous_response_id`) checked and turned into the chat turn
it is — the same TurnRequest a chat completion makes, so the chat template, tool parsing, structured
output and sessions (token-exact, continued from the messages a session holds) are the chat
path's. A refusal names the Responses field (`input[2].call_id`), not the chat one it became.

Pure logic: it knows the Responses and chat field names; nothing of HTTP, sessions or tokenizers.
The responses this server made are remembered (ResponseMemory) so a later request may continue one
by `previous_response_id`.
"""

from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from hfrt.serve.api import Limits, TurnRequest, chat_request
from hfrt.serve.errors import BadRequest

#: input item types this server reads (others, such as reasoning or web-search items, are refused)
ITEM_TYPES = ("message", "function_call", "function_call_output")
#: fields a Responses request may carry that change nothing here (store: responses are remembered
#: in memory anyway; metadata is echoed; truncation "disabled" is what is done)
ACCEPTED = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens", "temperature",
            "top_p", "text", "stream", "previous_response_id", "store", "metadata", "include", "user", "truncation",
            "top_logprobs", "seed", "stream_options", "service_tier", "prompt_cache_key", "safety_identifier")
#: include values honoured (the others name outputs this server never makes, and are ignored)
INCLUDE_LOGPROBS = "message.output_text.logprobs"


@dataclass(frozen=True)
class ResponsesTurn:
    """A Responses request as the chat turn it samples (`turn`) and what its response echoes."""

    turn: TurnRequest
    echo: dict[str, Any]
    logprobs: bool = False
    top_logprobs: int = 0
    format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    messages: list[dict[str, Any]] = field(default_factory=list)  # the chat messages, for previous_response_id
    tools: list[dict[str, Any]] | None = None  # the chat tools offered, for previous_response_id


@dataclass(frozen=True)
class Remembered:
    """A response this server made: its conversation as chat messages (instructions left out) with
    its reply as returned, and the tools it was offered."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class ResponseMemory:
    """Responses by id, at most `limit` (the oldest forgotten first), for previous_response_id."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit, self._items = limit, OrderedDict[str, Remembered]()

    def remember(self, response_id: str, item: Remembered) -> None:
        self._items[response_id] = item
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Remembered:
        if response_id not in self._items:
            raise BadRequest("previous_response_id", f"{response_id!r:.60} is not a response this server remembers "
                                                     f"(it keeps the last {self.limit}; send the whole input instead)", status=404,
                             code="previous_response_not_found")
        return self._items[response_id]


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex[:24]}"


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(where, f"must be a string or a list of input_text parts, not {content!r:.80}")


def _item_to_messages(item: Any, where: str, out: list[dict[str, Any]], paths: list[str]) -> None:
    """Append the chat message `item` makes (a function_call joins the assistant message before it)."""
    if not isinstance(item, dict):
        raise BadRequest(where, f"must be an input item object, not {item!r:.60}")
    kind = item.get("type", "message")
    if kind not in ITEM_TYPES:
        raise BadRequest(f"{where}.type", f"{kind!r:.40} is not supported: this server reads {', '.join(ITEM_TYPES)} items")
    if kind == "message":
        role = item.get("role")
        out.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
        paths.append(where)
        return
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{where}.call_id", "must be the call's id (a non-empty string)")
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
        out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        paths.append(where)
        return
    name, arguments = item.get("name"), item.get("arguments", "")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise BadRequest(where, "a function_call item needs a string name and arguments (a JSON string)")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if out and out[-1]["role"] == "assistant" and paths[-1] != "previous":  # a remembered message is not changed
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        paths.append(where)


def input_messages(body: dict[str, Any], previous: Remembered | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of `instructions`, the previous response's conversation and `input`, and
    for each the Responses path it came from (to name fields in refusals)."""
    messages: list[dict[str, Any]] = []
    paths: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions", f"must be a string, not {instructions!r:.60}")
        messages.append({"role": "system", "content": instructions})
        paths.append("instructions")
    if previous is not None:  # its conversation, not its instructions (OpenAI does not carry those over either)
        messages.extend(dict(m) for m in previous.messages)
        paths.extend(["previous"] * len(previous.messages))
    value = body.get("input")
    if isinstance(value, str):
        if not value:
            raise BadRequest("input", "is empty")
        messages.append({"role": "user", "content": value})
        paths.append("input")
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            _item_to_messages(item, f"input[{i}]", messages, paths)
    else:
        raise BadRequest("input", f"must be a string or a non-empty list of input items, not {value!r:.60}")
    return messages, paths


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters", "strict"}) as chat tools."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRequest("tools", f"must be a list of function tools, not {value!r:.60}")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadRequest(f"tools[{i}].type", f"{kind!r:.40} is not supported: only function tools (hosted tools need OpenAI's servers)")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and "function" not in value:
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _text_format(value: Any) -> dict[str, Any]:
    """`text`: {"format": {"type": "text" | "json_object" | "json_schema", ...}} (chat's response_format)."""
    if value is None:
        return {"type": "text"}
    fmt = value.get("format") if isinstance(value, dict) else None
    if fmt is None and isinstance(value, dict) and set(value) <= {"verbosity"}:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise BadRequest("text.format", f"must be an object with a type, not {value!r:.60}")
    if fmt.get("type") == "json_schema":  # Responses spells the schema flat; chat nests it under json_schema
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return dict(fmt)


def _include(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest("include", f"must be a list of strings, not {value!r:.60}")
    return INCLUDE_LOGPROBS in value


_PATH = re.compile(r"^messages\[(\d+)\](.*)$")


def _rename(exc: BadRequest, paths: list[str]) -> BadRequest:
    """A chat refusal with its field named as the Responses request spells it."""
    param = exc.param or ""
    match = _PATH.match(param)
    if match and int(match.group(1)) < len(paths):
        rest = match.group(2).replace(".tool_calls", "").replace(".tool_call_id", ".call_id")
        new = paths[int(match.group(1))] + ("" if paths[int(match.group(1))] == "instructions" else rest)
    else:
        new = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}.get(param, param)
        new = new.replace(".function.", ".")
    message = exc.message.removeprefix(f"{param}: ") if param else exc.message
    return BadRequest(new or None, message, status=exc.status, code=exc.code)


def responses_request(body: Any, *, limits: Limits = Limits(), tool_parser: str = "hermes",
                      memory: ResponseMemory | None = None, template: str | None = None) -> ResponsesTurn:
    """A /v1/responses body as the chat turn it samples (see the module docstring)."""
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - set(ACCEPTED))
    if unknown:
        raise BadRequest(unknown[0], f"is not supported by this server (it reads {', '.join(ACCEPTED)})")
    for name in ("conversation", "prompt", "background"):
        if body.get(name):
            raise BadRequest(name, "is not supported: this server keeps no conversations or stored prompts")
    previous_id = body.get("previous_response_id")
    previous = None
    if previous_id is not None:
        if not isinstance(previous_id, str) or memory is None:
            raise BadRequest("previous_response_id", f"must be the id of a response this server made, not {previous_id!r:.60}")
        previous = memory.get(previous_id)
    messages, paths = input_messages(body, previous)
    fmt = _text_format(body.get("text"))
    logprobs = _include(body.get("include"))
    chat_body = {"messages": messages, "model": body.get("model"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                 "max_completion_tokens": body.get("max_output_tokens"), "tools": _tools(body.get("tools")) or (previous.tools if previous else None),
                 "tool_choice": _tool_choice(body.get("tool_choice")), "parallel_tool_calls": body.get("parallel_tool_calls"),
                 "stream": body.get("stream"), "seed": body.get("seed"), "response_format": fmt if fmt.get("type") != "text" else None,
                 "logprobs": True if logprobs else None, "top_logprobs": body.get("top_logprobs") if logprobs else None}
    try:
        turn = chat_request({k: v for k, v in chat_body.items() if v is not None}, limits=limits, tool_parser=tool_parser,
                            template=template)
    except BadRequest as exc:
        raise _rename(exc, paths) from exc
    echo = {"instructions": body.get("instructions"), "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0), "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": previous_id,
            "metadata": body.get("metadata") or {}, "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "store": body.get("store", True), "truncation": body.get("truncation", "disabled"), "user": body.get("user")}
    conversation = messages[1:] if body.get("instructions") is not None else messages  # as sent (arguments as JSON strings)
    return ResponsesTurn(turn, echo, logprobs, int(body.get("top_logprobs") or 0) if logprobs else 0, fmt, conversation,
                         chat_body["tools"])


__all__ = ["ResponseMemory", "ResponsesTurn", "Remembered", "input_messages", "response_id", "responses_request"]
