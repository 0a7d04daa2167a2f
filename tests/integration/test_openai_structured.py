"""Structured output by constrained decoding on a real rollout daemon (tiny preset, HF engine,
llguidance): a random model's replies parse and follow the schema — response_format json_schema
(strict) and json_object, a forced tool call's strict arguments, streamed or not, through chat and
/v1/responses — and the log-probs recorded are those of the masked distribution the tokens were
sampled from (the first token of a JSON object, `{`, is the only one allowed: log-prob 0)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from hfrt.serve.server import OpenAIServer
from tests.integration.test_openai_server import POOL, call, chat_model, ctl  # noqa: F401  (fixtures)

openai = pytest.importorskip("openai", reason="the openai client is in the `test` extra")
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}, "op": {"enum": ["add", "mul"]}, "ok": {"type": "boolean"}},
          "required": ["sum", "op", "ok"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
ADD = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ctl: Any) -> AsyncIterator[OpenAIServer]:  # noqa: F811
    rollout = await ctl.role("rollout", timeout_s=90)
    async with OpenAIServer(rollout, model="tiny", flush_after_s=0.01, timeout_s=120) as srv:
        yield srv


def client(srv: OpenAIServer) -> Any:
    return openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)


async def in_thread(fn: Any) -> Any:
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(POOL, fn)


def follows(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"sum", "op", "ok"} and type(value["sum"]) is int and value["op"] in ("add", "mul") and type(value["ok"]) is bool


async def test_a_random_models_replies_follow_the_schema(server: OpenAIServer) -> None:
    out = await in_thread(lambda: client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "2+3"}], n=4, response_format=FORMAT, logprobs=True, top_logprobs=3))
    assert all(c.finish_reason == "stop" and follows(c.message.content) for c in out.choices), [c.message.content for c in out.choices]
    for choice in out.choices:  # "{" is the only token the grammar allows first: sampled with probability 1
        first = choice.logprobs.content[0]
        assert first.logprob == 0.0 and [t.logprob for t in first.top_logprobs] == [0.0]
    streamed = await in_thread(lambda: list(client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "2+3"}], response_format=FORMAT, stream=True)))
    assert follows("".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
    # any JSON object (biased towards closing its strings and itself, or a random model writes past the context)
    close = {str(ord('"') - 30): 4, str(ord("}") - 30): 4}
    obj = await in_thread(lambda: client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}, logit_bias=close))
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


async def test_a_forced_calls_strict_arguments_follow_the_schema(server: OpenAIServer) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        out = await in_thread(lambda c=choice: client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "2+3"}], tools=[ADD], tool_choice=c))
        [call] = out.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        assert set(arguments) == {"a", "b"} and all(type(v) is int for v in arguments.values()), arguments


async def test_text_format_of_the_responses_api_is_the_same_constraint(server: OpenAIServer) -> None:
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    out = await in_thread(lambda: client(server).responses.create(model="tiny", input="2+3", text=fmt))
    assert out.status == "completed" and follows(out.output_text)
    status, error = await call(server, "/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "response_format": {"type": "json_schema", "json_schema": {
                                                                 "name": "bad", "schema": {"type": "frobnicate"}}}})
    assert status == 400 and error["error"]["param"] == "response_format", error

