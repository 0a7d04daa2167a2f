"""Tool calling for the OpenAI-compatible endpoint: the `tools` and `tool_choice` fields checked,
and sampled text parsed into OpenAI `tool_calls` by a parser per model family — `hermes`
(Hermes / Qwen 2.5+: `<tool_call>{"name", "arguments"}</tool_call>`) or `llama3` (Llama 3.x:
a bare `{"name", "parameters"}` object, optionally after `<|python_tag|>`, several joined by `;`).

Pure logic: it knows those text formats and OpenAI's tool shapes, nothing of HTTP or tokenizers
(tools reach the model through its chat template on the rollout daemon). Text that does not parse
into calls of offered tools stays the message content: a parser never fails a request.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from hfrt.serve.errors import BadRequest


def _bad(param: str, message: str) -> Exception:
    return BadRequest(param, message)


@dataclass(frozen=True)
class Tool:
    """One offered function: its name and the {"type": "function", "function": {...}} schema the
    chat template renders."""

    name: str
    schema: dict[str, Any]


def check_tools(value: Any) -> list[Tool]:
    """`tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if value is None or value == []:
        return []
    if not isinstance(value, list):
        raise _bad("tools", f"must be a list of function tools, not {value!r:.60}")
    tools: list[Tool] = []
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise _bad(f"tools[{i}].function.name", f"{name!r:.40} must be 1-64 letters, digits, '_', '.' or '-'")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"tools[{i}].function.description", "must be a string")
        if any(t.name == name for t in tools):
            raise _bad(f"tools[{i}].function.name", f"{name!r} is offered twice")
        schema = {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}}
        tools.append(Tool(name, schema))
    return tools


def check_tool_choice(value: Any, tools: list[Tool]) -> str:
    """`tool_choice`: "auto" (the default with tools), "none", "required", or
    {"type": "function", "function": {"name"}} naming an offered tool (its name is returned)."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise _bad("tool_choice", "\"required\" needs tools")
        return str(value)
    name = value.get("function", {}).get("name") if isinstance(value, dict) and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", f"must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\"}}}}, not {value!r:.60}")
    if name not in {t.name for t in tools}:
        raise _bad("tool_choice", f"names the unknown tool {name!r} (offered: {[t.name for t in tools]})")
    return name


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


class ToolParser(Protocol):
    name: str
    #: the call JSON's key for the arguments, and the text that opens a call (put after the
    #: generation prompt when a call is forced: the call's JSON is then sampled under its schema)
    arguments_key: str
    opening: str

    def parse(self, text: str, tools: list[Tool]) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of sampled text; ([text], []) when it holds no valid calls."""
        ...


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, text before the first call
    is the content; a last call cut off before `</tool_call>` is parsed if its JSON is whole."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    arguments_key, opening = "arguments", "<tool_call>\n"

    def parse(self, text: str, tools: list[Tool]) -> tuple[str | None, list[dict[str, Any]]]:
        if self.OPEN not in text:
            return text, []
        head, _, rest = text.partition(self.OPEN)
        calls = []
        for block in rest.split(self.OPEN):
            body = block.split(self.CLOSE)[0].strip()
            call = _decode(body)
            if call is None or call[0] not in {t.name for t in tools}:
                return text, []
            calls.append(_openai_call(*call))
        return (head.strip() or None), calls


class Llama3Parser:
    """Llama 3.x JSON tool calls: the whole turn is `{"name": ..., "parameters": {...}}` (or
    "arguments"), optionally after `<|python_tag|>`, several separated by `;`."""

    name = "llama3"
    arguments_key, opening = "parameters", ""

    def parse(self, text: str, tools: list[Tool]) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _named(value)
            if call is None or call[0] not in {t.name for t in tools}:
                return text, []
            calls.append(_openai_call(*call))
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return None, calls


def _named(value: Any) -> tuple[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return (value["name"], arguments) if isinstance(arguments, (dict, str)) else None


def _decode(body: str) -> tuple[str, Any] | None:
    try:
        return _named(json.loads(body))
    except ValueError:
        return None


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3": Llama3Parser()}


def parser_for(name: str) -> ToolParser:
    """The tool-call parser named `name` (a ValueError naming the choices otherwise)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}: choose one of {sorted(PARSERS)}")
    return PARSERS[name]
