"""The request side of /v1/responses (hfrt/serve/responses_api.py) and its events
(responses_events.py): items become the chat messages a chat completion would send, refusals name
the Responses field, and the events parse as the openai client's own types (the compatibility table of
docs/agents-and-openai.md). Pure logic."""

from __future__ import annotations

from typing import Any

import pytest

from hfrt.serve.errors import BadRequest
from hfrt.serve.responses import TurnResult
from hfrt.serve.responses_api import Remembered, ResponseMemory, responses_request
from hfrt.serve.responses_events import ResponseEvents, ResponseShape


def test_items_become_the_chat_messages_of_the_same_conversation() -> None:
    rt = responses_request({"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "2+3"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"}],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}], "max_output_tokens": 7})
    assert [(m["role"], m.get("content")) for m in rt.turn.messages] == [("system", "be brief"), ("user", "2+3"), ("assistant", "calling"),
                                                                        ("tool", "5")]
    assert rt.turn.messages[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert [t.name for t in rt.turn.tools] == ["add"] and rt.turn.options["max_new_tokens"] == 7
    assert rt.messages[0]["role"] == "user"  # what previous_response_id continues leaves the instructions out
    omitted = responses_request({"input": "hi"})
    assert omitted.turn.options.get("fit_context") is True  # no max_output_tokens: until the context is full


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": 3}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "temperature": 9}, "temperature"), ({"input": "x", "text": {"format": "json"}}, "text.format"),
    ({"input": "x", "conversation": "c1"}, "conversation"), ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"), ({"input": "x", "background": True}, "background"),
])
def test_refusals_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        responses_request(body)
    assert info.value.param == param, info.value.message


def test_previous_response_id_continues_a_remembered_conversation() -> None:
    memory = ResponseMemory(limit=1)
    memory.remember("resp_a", Remembered([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], None))
    rt = responses_request({"input": "and?", "previous_response_id": "resp_a", "instructions": "new"}, memory=memory)
    assert [m["content"] for m in rt.turn.messages] == ["new", "hi", "hello", "and?"]
    memory.remember("resp_b", Remembered([], None))  # past the limit: the oldest is forgotten
    with pytest.raises(BadRequest) as info:
        responses_request({"input": "x", "previous_response_id": "resp_a"}, memory=memory)
    assert info.value.status == 404 and info.value.code == "previous_response_not_found"


def test_the_events_parse_as_the_openai_clients_types() -> None:
    openai_types = pytest.importorskip("openai.types.responses", reason="the openai client is in the `test` extra")
    from pydantic import TypeAdapter

    rt = responses_request({"input": "hi", "tools": [{"type": "function", "name": "add"}]})
    shape = ResponseShape(rt, "tiny", 1)
    result = TurnResult([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], "hi", 0)
    message = {"role": "assistant", "content": "hi", "tool_calls": [{"id": "call_1", "type": "function",
                                                                      "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    final = shape.final(result, message, "tool_calls")
    events = ResponseEvents(shape)
    raw = [*events.start(), *events.text_delta("hi", []), *events.finish(final)]
    adapter = TypeAdapter(openai_types.ResponseStreamEvent)
    parsed = [adapter.validate_json(chunk.decode().split("data: ", 1)[1]) for chunk in raw]
    assert [p.type for p in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = parsed[-1].response
    assert done.output_text == "hi" and done.output[1].arguments == '{"a": 1}' and done.usage.output_tokens == 3
    assert openai_types.Response.model_validate(final).status == "completed"
