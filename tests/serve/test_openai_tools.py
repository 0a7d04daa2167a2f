"""Tool calling logic of the OpenAI endpoint: `tools` / `tool_choice` checks naming the field, the
Hermes and Llama-3 parsers (unparseable text or unknown tools stay content), the prefills that
make `required` / a named function open a call, chat requests with tool messages, the API key's
sources, and sessions split into exact trajectories where a client re-renders its history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfrt.serve.api import BadRequest, chat_request
from hfrt.serve.command import api_key_from
from hfrt.serve.sessions import Session, SessionCall, build_trajectories
from hfrt.serve.tools import check_tool_choice, check_tools, parser_for

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
MUL = {"type": "function", "function": {"name": "mul"}}
TOOLS = check_tools([ADD, MUL])


def test_hermes_parser() -> None:
    hermes = parser_for("hermes")
    content, calls = hermes.parse('thinking <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                                  '<tool_call>{"name": "mul", "arguments": {}}</tool_call>', TOOLS)
    assert content == "thinking" and [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1} and calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert hermes.parse('<tool_call>{"name": "add", "arguments": {"a": 2}}', TOOLS)[1][0]["function"]["name"] == "add"  # cut before the close
    for text in ("no call", "<tool_call>{not json</tool_call>", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "<tool_call>[1]"):
        assert hermes.parse(text, TOOLS) == (text, [])  # stays content, never an error
    # a forced call: the opening is prompt, the call's compact JSON sampled under its schema (and no close)
    assert hermes.parse(hermes.opening + '{"name":"add","arguments":{"a":3}}', TOOLS)[1][0]["function"]["arguments"] == '{"a": 3}'


def test_llama3_parser() -> None:
    llama = parser_for("llama3")
    content, calls = llama.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "mul", "arguments": {"b": 2}}', TOOLS)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"b": 2}]
    for text in ("plain text", '{"name": "add", "parameters": {"a": ', '{"name": "nope", "parameters": {}}', '{"x": 1}'):
        assert llama.parse(text, TOOLS) == (text, [])
    assert llama.parse(llama.opening + '{"name":"mul","parameters":{"b":5}}', TOOLS)[1][0]["function"]["name"] == "mul"
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'"):
        parser_for("qwen")


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ("x", None, "tools"), ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
    ([ADD, ADD], None, "tools[1].function.name"), ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools[0].function.parameters"),
    ([ADD], "sometimes", "tool_choice"), ([ADD], {"type": "function", "function": {"name": "mul"}}, "tool_choice"), ([], "required", "tool_choice"),
])
def test_tool_fields_are_checked_naming_the_field(tools: object, choice: object, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        check_tool_choice(choice, check_tools(tools))
    assert info.value.param == param and info.value.status == 400


def test_chat_request_with_tools_and_tool_messages() -> None:
    messages = [{"role": "user", "content": "1+2"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    turn = chat_request({"messages": messages, "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert turn.tool_choice == "add" and turn.prefill == "<tool_call>\n" and turn.append[1] == turn.prefill
    assert turn.options["json_schema"] == {"type": "object", "properties": {"name": {"const": "add"}, "arguments": ADD["function"]["parameters"]},
                                           "required": ["name", "arguments"], "additionalProperties": False}  # the forced call is constrained
    required = chat_request({"messages": messages[:1], "tools": [ADD, MUL], "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert [o["properties"]["name"]["const"] for o in required.options["json_schema"]["anyOf"]] == ["add", "mul"]  # the call wins
    assert turn.append[0]["tools"] == [ADD] and turn.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # as templates render it
    assert turn.messages[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    off = chat_request({"messages": messages[:1], "tools": [ADD], "tool_choice": "none"})
    assert off.tools == [] and off.append == [{"messages": messages[:1], "tools": None}]


def test_api_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HFRT_API_KEY", raising=False)
    assert api_key_from() is None and api_key_from("k1") == "k1"
    (tmp_path / "key").write_text("k2\n")
    assert api_key_from("", str(tmp_path / "key")) == "k2"
    monkeypatch.setenv("HFRT_API_KEY", "k3")
    assert api_key_from() == "k3"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        api_key_from("", str(tmp_path / "empty"))


def test_a_re_rendered_session_splits_into_exact_trajectories() -> None:
    session = Session([SessionCall([1, 2], [3], [-0.1], 0), SessionCall([1, 2, 3, 9], [4], [-0.2], 0),
                       SessionCall([1, 5], [6], [-0.3], 1)])  # the client rewrote its history
    first, second = build_trajectories("s", session)
    assert first.response_ids == [3, 9, 4] and first.gen_mask == [1, 0, 1] and first.turns == 2
    assert second.prompt_ids == [1, 5] and second.response_ids == [6] and second.sample == {"session": "s/1"}


def test_loopback_hosts_are_told_apart() -> None:
    from hfrt.serve.app import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.org"))


def test_the_bearer_scheme_is_read_in_any_case() -> None:
    from hfrt.serve.app import bearer_key

    assert [bearer_key(h) for h in ("Bearer k1", "bearer k1", "BEARER  k1 ", "Basic k1", "Bearer", "k1", "")] == \
        ["k1", "k1", "k1", None, None, None, None]
