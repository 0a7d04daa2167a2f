"""The OpenAI request checks (each refusal names its field, hostile JSON included), the response
shapes with hfrt's token-in/token-out fields, and session trajectories (gen_mask 1 exactly on
sampled tokens; drift named with the session, call and first differing token)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hfrt.serve.api import BadRequest, chat_request, completion_request, error_body, parse_body
from hfrt.serve.responses import TurnResult, chat_body, completion_body, event_stream
from hfrt.serve.sessions import Session, SessionCall, SessionDrift, build_trajectory


def test_completion_request_forms() -> None:
    text = completion_request({"prompt": "1+1=", "max_tokens": 5, "temperature": 0, "stop": "\n", "seed": 7, "user": "s"})
    assert (text.context, text.append, text.text_prompt, text.user) == ([], ["1+1="], "1+1=", "s")
    assert text.options == {"max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "stop": ["\n"], "seed": 7}
    ids = completion_request({"prompt": [[3, 4, 5]], "logprobs": 0})
    assert (ids.context, ids.append, ids.text_prompt, ids.logprobs) == ([3, 4, 5], [], None, True)
    assert completion_request({"prompt": ["one"], "n": 1, "stream": False, "logit_bias": {}}).append == ["one"]
    assert completion_request({"prompt": "x", "n": 4}).n == 4
    shaped = completion_request({"prompt": "x", "stop": ["Observation:", "\n\n"], "presence_penalty": 0.5, "frequency_penalty": -1,
                                 "logit_bias": {"7": -100, "9": 2.5}, "include_stop_str_in_output": True})
    assert shaped.options == {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0, "stop": ["Observation:", "\n\n"],
                              "presence_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {"7": -100.0, "9": 2.5},
                              "include_stop_str_in_output": True}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "n": 17}, "n"), ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": float("nan")}, "top_p"), ({"prompt": [18446744073709551621]}, "prompt"), ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"), ({"prompt": [True]}, "prompt"), ({"prompt": ""}, "prompt"), ({}, "prompt"),
    ({"prompt": "x", "temperature": 3}, "temperature"), ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 4097}, "max_tokens"), ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "stop": ["", "a"]}, "stop"), ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"), ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"12": 101}}, "logit_bias.12"), ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"), ({"prompt": "x", "stop": ["x"] * 17}, "stop"),
    ({"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"), ({"prompt": "x", "user": 5}, "user"),
])
def test_completion_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        completion_request(body)
    assert info.value.status == 400 and info.value.param == param
    assert error_body(info.value)["error"]["param"] == param and info.value.message.startswith(param)


@pytest.mark.parametrize(("raw", "param", "match"), [
    (b"", None, "no body"), (b"{", None, "not valid JSON"), (b"\xff", None, "not valid JSON"), (b"[" * 100_000, None, "nested deeper"),
    (b"[" * 70 + b"]" * 70, None, "nested deeper"), (b'{"prompt": "\\ud800"}', "prompt", "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content", "lone surrogate"),
])
def test_hostile_bodies_are_400s_naming_the_field(raw: bytes, param: str | None, match: str) -> None:
    with pytest.raises(BadRequest, match=match) as info:
        parse_body(raw)
    assert info.value.status == 400 and info.value.param == param
    assert parse_body(b'{"temperature": NaN}') == {"temperature": pytest.approx(float("nan"), nan_ok=True)}  # then refused by field


def test_chat_request_and_refusals() -> None:
    turn = chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                      {"role": "assistant", "content": None, "name": "x"}], "max_completion_tokens": 9, "logprobs": True})
    assert turn.append == [{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}], "tools": None}]
    assert turn.options["max_new_tokens"] == 9 and turn.logprobs and turn.context == []
    cases = [
        ({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ]
    for body, param in cases:
        with pytest.raises(BadRequest) as info:
            chat_request(body)
        assert info.value.param == param, body
    with pytest.raises(BadRequest, match="must be a JSON object"):
        chat_request([1])


def test_response_shapes_carry_token_ids() -> None:
    result = TurnResult.from_row([5, 6], {"appended": [[7]], "turn_ids": [8, 9], "turn_log_probs": [-0.5, -1.0],
                                          "turn_text": "hi", "weight_version": 3})
    assert result.prompt_ids == [5, 6, 7]
    out = completion_body(completion_request({"prompt": [5, 6], "max_tokens": 2, "logprobs": 0}), [result], "m")
    assert out["prompt_token_ids"] == [5, 6, 7] and out["weight_version"] == 3 and out["model"] == "m"
    choice = out["choices"][0]
    assert choice["token_ids"] == [8, 9] and choice["text"] == "hi" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.0] and choice["logprobs"]["tokens"] == ["token_id:8", "token_id:9"]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    two = completion_body(completion_request({"prompt": [5, 6], "max_tokens": 2, "n": 2}), [result, result], "m")
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["completion_tokens"] == 4
    chat = chat_body(chat_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}), [result], "m")
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"} and chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["logprobs"] is None and chat["id"].startswith("chatcmpl-")


def test_session_trajectory_and_drift() -> None:
    session = Session([SessionCall([1, 2], [3, 4], [-0.1, -0.2], 0), SessionCall([1, 2, 3, 4, 9], [5], [-0.3], 1),
                       SessionCall([1, 2, 3, 4, 9, 5], [6], [-0.4], 1)])
    t = build_trajectory("s", session)
    assert t.prompt_ids == [1, 2] and t.response_ids == [3, 4, 9, 5, 6]
    assert t.gen_mask == [1, 1, 0, 1, 1] and t.log_probs == [-0.1, -0.2, 0.0, -0.3, -0.4]
    assert t.weight_versions == [0, 1, 1] and t.turns == 3 and t.sample == {"session": "s"}
    session.calls.append(SessionCall([1, 2, 3, 4, 8], [7], [-0.5], 1))
    with pytest.raises(SessionDrift, match=r"session 's': call 3's prompt .*first difference at token 4 of 7: held 9, prompt has 8"):
        build_trajectory("s", session)
    short = Session([SessionCall([1, 2], [3], [-0.1], 0), SessionCall([1, 2], [4], [-0.1], 0)])
    with pytest.raises(SessionDrift, match="token 2 of 3: held 3, prompt has end of prompt"):
        build_trajectory("short", short)
    with pytest.raises(KeyError, match="no calls"):
        build_trajectory("empty", Session())


def test_streamed_responses_are_server_sent_events_token_by_token() -> None:
    result = TurnResult([5], [8, 9], [-0.5, -1.0], "hi", 3, pieces=["h", "i"])
    turn = chat_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True, "logprobs": True,
                         "stream_options": {"include_usage": True}})
    events = b"".join(event_stream(turn, [result], chat_body(turn, [result], "m"))).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    role, h, i, end, usage = (json.loads(e[6:]) for e in events[:5])
    assert role["object"] == "chat.completion.chunk" and role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == [5] and role["weight_version"] == 3 and "prompt_token_ids" not in h
    assert [h["choices"][0]["delta"]["content"], i["choices"][0]["delta"]["content"]] == ["h", "i"]
    assert h["choices"][0]["token_ids"] == [8] and h["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    assert end["choices"][0]["finish_reason"] == "length" and usage["usage"]["total_tokens"] == 3 and usage["choices"] == []
    plain = completion_request({"prompt": "x", "stream": True})
    events = b"".join(event_stream(plain, [result], completion_body(plain, [result], "m"))).decode().split("\n\n")
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:3]] == ["h", "i", ""] and len(events) == 5


def test_streamed_text_holds_back_what_may_become_a_stop_string() -> None:
    from hfrt.serve.stops import StopHoldback

    hold = StopHoldback(["Observation:"])
    sent = [hold.feed(p) for p in ["I will", " add.\nObs", "erv", "ation: 5", " more"]]
    assert sent == ["I will", " add.\n", "", "", ""] and hold.stopped
    kept = StopHoldback(["Observation:"], include=True)
    assert "".join(kept.feed(p) for p in ["a Obs", "ervation: 5"]) == "a Observation:"
    loose = StopHoldback(["Observation:"])
    assert [loose.feed(p) for p in ["Ob", "ject"]] == ["", "Object"]  # not a stop after all: sent once it cannot be one
    assert [StopHoldback([]).feed(p) for p in ["a", "b"]] == ["a", "b"]


def test_pieces_are_clipped_to_the_returned_text() -> None:
    from hfrt.serve.responses import clip_pieces

    assert clip_pieces(["The", " sum", "\nObs", "ervation:"], "The sum\n") == ["The", " sum", "\n", ""]
    assert clip_pieces(["a", ""], "ab") == ["a", "b"]  # a character the pieces held back joins the last one


def test_response_format_becomes_the_schema_the_reply_is_sampled_under() -> None:
    from hfrt.serve.api import chat_request

    msgs = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    assert "json_schema" not in chat_request({"messages": msgs, "response_format": {"type": "text"}}).options
    assert chat_request({"messages": msgs, "response_format": {"type": "json_object"}}).options["json_schema"] == {"type": "object"}
    strict = chat_request({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}})
    assert strict.options["json_schema"] == schema
    loose = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    assert chat_request({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": loose}}}
                        ).options["json_schema"] == loose  # constrained without strict too
    for bad, param in (({"type": "yaml"}, "response_format"), ({"type": "json_schema", "json_schema": {"schema": 5}}, "response_format.json_schema.schema"),
                       ({"type": "json_schema", "json_schema": {"name": "a", "schema": loose, "strict": True}}, "response_format.json_schema.schema")):
        with pytest.raises(BadRequest) as info:
            chat_request({"messages": msgs, "response_format": bad})
        assert info.value.param == param, info.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"function_call": {"name": "f"}}, "function_call"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "x"}}, "audio"), ({"web_search_options": {}}, "web_search_options"), ({"top_k": -2}, "top_k"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
])
def test_chat_fields_this_server_cannot_honour_are_refused_naming_them(body: dict[str, Any], param: str) -> None:
    from hfrt.serve.api import chat_request

    with pytest.raises(BadRequest) as info:
        chat_request({"messages": [{"role": "user", "content": "x"}], **body})
    assert info.value.param == param  # the compatibility table of docs/agents-and-openai.md
    assert chat_request({"messages": [{"role": "user", "content": "x"}], "top_k": 5, "modalities": ["text"]}).options["top_k"] == 5
