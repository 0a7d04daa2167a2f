"""Structured output for the OpenAI-compatible endpoint: what `response_format` asks for, and the
JSON schema of a forced tool call, as the `json_schema` option the rollout daemon samples under by
constrained decoding (llguidance on the HF engine, vLLM's structured outputs on vLLM), so the reply
parses whatever the policy's weights are.

- `{"type": "json_object"}`: any JSON object; `{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`: JSON following the schema — constrained whether `strict` is true or not,
  as vLLM does (with strict, the schema is held to OpenAI's strict-mode rules first: every object
  lists its properties, all required).
- A call the request forces (`tool_choice` "required" or a named function) is sampled as the tool
  parser's call JSON, its arguments following the function's `parameters`, after the parser's
  opening (Hermes: `<tool_call>\\n`); with `auto`, calls are parsed, not constrained (vLLM's rule).
  A forced call wins over `response_format`.

Pure logic: it knows OpenAI's field shapes and the parsers' call JSON; nothing of grammars.
"""

from __future__ import annotations

from typing import Any

from hfrt.serve.errors import BadRequest
from hfrt.serve.tools import Tool


def response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks the reply to follow (None: plain text)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise BadRequest("response_format", f"must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\"}}, not {value!r:.80}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise BadRequest("response_format.json_schema", "must be {\"name\", \"schema\": a JSON schema, \"strict\"?}")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise BadRequest("response_format.json_schema.schema", f"must be a JSON schema object, not {schema!r:.60}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise BadRequest("response_format.json_schema.strict", f"must be true or false, not {spec['strict']!r:.40}")
    if spec.get("strict"):
        check_strict(schema, "response_format.json_schema.schema")
    return schema


def check_strict(schema: Any, where: str) -> None:
    """OpenAI's strict-mode rules: every object lists `properties`, all of them `required`, and
    takes no others (`additionalProperties` false where given) — refused naming the path otherwise."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_strict(item, f"{where}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        missing = sorted(set(props) - set(schema.get("required") or []))
        if missing:
            raise BadRequest(where, f"strict mode needs every property required; {missing} are not (make them required, with "
                                    "a null type for optional ones)")
        if schema.get("additionalProperties", False) is not False:
            raise BadRequest(where, "strict mode needs \"additionalProperties\": false")
    for key, value in schema.items():
        if isinstance(value, (dict, list)) and key not in ("enum", "const", "required", "examples", "default"):
            check_strict(value, f"{where}.{key}")


def call_schema(tools: list[Tool], choice: str, arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call of a tool `choice` allows ("required": any offered tool; else
    the named one): {"name": the tool, `arguments_key`: its parameters}."""
    allowed = [t for t in tools if choice == "required" or t.name == choice]
    options = []
    for tool in allowed:
        parameters = tool.schema["function"].get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: parameters},
                        "required": ["name", arguments_key], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}
