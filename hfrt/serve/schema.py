"""The OpenAPI 3.1 description of what the OpenAI-compatible endpoint supports (served at
/openapi.json): its routes, the request fields it reads with their ranges and the server's
limits, the response extension fields, and the bearer-key scheme.

Pure data: it knows the supported fields, nothing of serving them (api.py checks them).
"""

from __future__ import annotations

from typing import Any

_NUMBER = {"type": "number"}
_STRING = {"type": "string"}
_STOP = {"oneOf": [_STRING, {"type": "array", "items": _STRING}]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def _sampling(limits: Any) -> dict[str, Any]:
    return {
        "model": _STRING, "user": {**_STRING, "description": "the end user, for attribution only (sessions are keyed by the header X-Session-Id)"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens, "default": 16},
        "temperature": {**_NUMBER, "minimum": 0, "maximum": 2, "default": 1},
        "top_p": {**_NUMBER, "exclusiveMinimum": 0, "maximum": 1, "default": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "default": 1},
        "seed": {"type": "integer"}, "stop": {**_STOP, "description": "each stop string must be one token"},
        "stream": {"type": "boolean"}, "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    }


def _message() -> dict[str, Any]:
    call = {"type": "object", "properties": {"id": _STRING, "type": {"const": "function"},
                                              "function": {"type": "object", "properties": {"name": _STRING, "arguments": _STRING}}}}
    return {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [_STRING, {"type": "null"}, {"type": "array", "items": {"type": "object", "properties": {
            "type": {"const": "text"}, "text": _STRING}}}]},
        "tool_calls": {"type": "array", "items": call}, "tool_call_id": _STRING, "name": _STRING}}


def _request(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"post": {"operationId": name, "security": [{"bearer": []}],
                     "parameters": [{"name": "X-Session-Id", "in": "header", "required": False, "schema": _STRING}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {
                         "type": "object", "required": required, "properties": properties}}}},
                     "responses": {"200": {"description": "the sampled choices (JSON, or server-sent events with stream), with "
                                                          "prompt_token_ids, per-choice token_ids and weight_version"},
                                   "400": {"$ref": "#/components/responses/error"}, "401": {"$ref": "#/components/responses/error"},
                                   "408": {"$ref": "#/components/responses/error"}, "413": {"$ref": "#/components/responses/error"},
                                   "429": {"$ref": "#/components/responses/error"},
                                   "503": {"description": "the rollout role is unavailable; with a Retry-After header while a "
                                                          "daemon that stopped is being replaced",
                                           "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                                           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}}}}}


def openapi_schema(model: str, limits: Any) -> dict[str, Any]:
    """The schema for a server sampling `model` under `limits` (a ServerLimits)."""
    completion = {**_sampling(limits), "prompt": {"oneOf": [_STRING, _TOKEN_IDS]},
                  "logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "description": "alternatives per token (0: the sampled token only)"}}
    tool = {"type": "object", "properties": {"type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": _STRING, "description": _STRING, "parameters": {"type": "object"}}}}}
    chat = {**_sampling(limits), "messages": {"type": "array", "minItems": 1, "items": _message()},
            "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens},
            "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "tools": {"type": "array", "items": tool}, "parallel_tool_calls": {"type": "boolean"},
            "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, {"type": "object", "properties": {
                "type": {"const": "function"}, "function": {"type": "object", "properties": {"name": _STRING}}}}]}}
    item = {"type": "object", "properties": {"type": {"enum": ["message", "function_call", "function_call_output"]}, "role": _STRING,
                                              "content": {"oneOf": [_STRING, {"type": "array"}]}, "call_id": _STRING, "name": _STRING,
                                              "arguments": _STRING, "output": _STRING}}
    responses = {"model": _STRING, "input": {"oneOf": [_STRING, {"type": "array", "items": item}]}, "instructions": _STRING,
                 "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
                     "type": {"const": "function"}, "name": _STRING, "description": _STRING, "parameters": {"type": "object"},
                     "strict": {"type": "boolean"}}}},
                 "tool_choice": chat["tool_choice"], "parallel_tool_calls": {"type": "boolean"},
                 "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens},
                 "temperature": _sampling(limits)["temperature"], "top_p": _sampling(limits)["top_p"], "stream": {"type": "boolean"},
                 "text": {"type": "object", "properties": {"format": {"type": "object"}}}, "previous_response_id": _STRING,
                 "include": {"type": "array", "items": _STRING}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                 "store": {"type": "boolean"}, "metadata": {"type": "object"}}
    error = {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": _STRING, "type": _STRING, "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "hfrt OpenAI-compatible endpoint", "version": "1",
                 "description": f"samples {model!r} on hfrt's rollout role; max_body_bytes {limits.max_body_bytes}, "
                                f"max_concurrent_requests {limits.max_concurrent_requests}, request_timeout_s {limits.request_timeout_s}, "
                                f"header_timeout_s {limits.header_timeout_s}, body_timeout_s {limits.body_timeout_s}"},
        "paths": {
            "/v1/models": {"get": {"operationId": "listModels", "security": [{"bearer": []}],
                                   "responses": {"200": {"description": "the one model served"}}}},
            "/v1/completions": _request("createCompletion", completion, ["prompt"]),
            "/v1/chat/completions": _request("createChatCompletion", chat, ["messages"]),
            "/v1/responses": _request("createResponse", responses, ["input"]),
        },
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": {"error": error},
                       "responses": {"error": {"description": "OpenAI's error shape; param names the field, code the limit",
                                               "content": {"application/json": {"schema": error}}}}},
    }
