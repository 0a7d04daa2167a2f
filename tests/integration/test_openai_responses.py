"""`POST /v1/responses` over real HTTP with real clients: the official `openai` client (items,
function calls and their outputs, previous_response_id, streaming events) and the OpenAI Agents
SDK's default model (OpenAIResponsesModel) running an agent with a function tool, streamed. A
scripted rollout role (test_openai_clients.ScriptedChatRollout: it answers a user turn with a
Hermes tool call and a tool result with the sum) tests the server, the item conversion and the
sessions; a real tiny-preset daemon tests the event stream and that a Responses turn samples and
records exactly what the same chat completion does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from hfrt.serve.server import OpenAIServer, ServerLimits
from tests.integration.test_openai_clients import POOL, ScriptedChatRollout
from tests.integration.test_openai_server import chat_model, ctl  # noqa: F401  (fixtures)

openai = pytest.importorskip("openai", reason="the openai client is in the `test` extra")
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
ADD = {"type": "function", "name": "add", "description": "add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scripted() -> AsyncIterator[OpenAIServer]:
    limits = ServerLimits(long_request_tokens=10**6)
    async with OpenAIServer(ScriptedChatRollout(), model="scripted", flush_after_s=0.01, limits=limits) as srv:
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny(ctl: Any) -> AsyncIterator[OpenAIServer]:  # noqa: F811
    rollout = await ctl.role("rollout", timeout_s=90)
    async with OpenAIServer(rollout, model="tiny", flush_after_s=0.01, timeout_s=60) as srv:
        yield srv


def client(srv: OpenAIServer, session: str | None = None) -> Any:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, default_headers=headers)


async def in_thread(fn: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(POOL, fn)


async def test_a_function_call_round_trip_is_one_exact_trajectory(scripted: OpenAIServer) -> None:
    def talk() -> tuple[Any, Any, Any]:
        c = client(scripted, "calc")
        first = c.responses.create(model="scripted", instructions="add", input="what is 20 + 22?", tools=[ADD])
        [call] = [o for o in first.output if o.type == "function_call"]
        result = sum(json.loads(call.arguments).values())
        history = [{"role": "user", "content": "what is 20 + 22?"}, *[o.model_dump(exclude_none=True) for o in first.output],
                   {"type": "function_call_output", "call_id": call.call_id, "output": str(result)}]
        second = c.responses.create(model="scripted", instructions="add", input=history, tools=[ADD])
        # the same continuation by previous_response_id: only the new item is sent
        third = client(scripted).responses.create(model="scripted", instructions="add", previous_response_id=first.id, tools=[ADD],
                                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": str(result)}])
        fourth = client(scripted).responses.create(model="scripted", instructions="add", input=history, tools=[ADD])
        return first, second, third, fourth

    first, second, third, fourth = await in_thread(talk)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "add"
    assert json.loads(call.arguments) == {"a": 20, "b": 22} and call.call_id.startswith("call_")
    assert second.output_text == "The sum is 42." and third.output_text == "The sum is 42."
    assert third.model_extra["prompt_token_ids"] == fourth.model_extra["prompt_token_ids"]  # what was remembered is what was sent
    t = scripted.end_session("calc")
    out1, out2 = first.model_extra["token_ids"], second.model_extra["token_ids"]
    tool_part = [ord(c) for c in "<tool>42\n<assistant>"]  # only what the template renders past the held tokens
    assert t.prompt_ids == first.model_extra["prompt_token_ids"] and t.turns == 2
    assert t.response_ids == out1 + tool_part + out2 and t.gen_mask == [1] * len(out1) + [0] * len(tool_part) + [1] * len(out2)
    assert first.usage.input_tokens == len(t.prompt_ids) and first.usage.output_tokens == len(out1)


async def test_refusals_name_the_responses_field(scripted: OpenAIServer) -> None:
    def ask(**body: Any) -> Any:
        try:
            client(scripted).responses.create(model="scripted", **body)
        except openai.BadRequestError as exc:
            return exc.body
        except openai.NotFoundError as exc:
            return exc.body
        raise AssertionError(f"accepted: {body}")

    cases = [({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "5"}]}, "input[1].call_id"),
             ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
             ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
             ({"input": "x", "instructions": 5}, "instructions"), ({"input": []}, "input")]
    for body, param in cases:
        error = await in_thread(lambda b=body: ask(**b))
        assert error["param"] == param, (body, error)


async def test_the_agents_sdk_runs_a_function_tool_streamed(scripted: OpenAIServer) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the `test` extra")

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def run() -> tuple[Any, list[str]]:
        agents.set_tracing_disabled(True)
        async with openai.AsyncOpenAI(base_url=scripted.url, api_key="unused", max_retries=0,
                                      default_headers={"X-Session-Id": "agent"}) as sdk_client:  # closed on this loop
            model = agents.OpenAIResponsesModel("scripted", sdk_client)
            agent = agents.Agent(name="calc", instructions="Use the add tool.", tools=[add], model=model)
            result = agents.Runner.run_streamed(agent, "what is 20 + 22?")
            kinds = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
        return result, kinds

    result, kinds = await in_thread(lambda: asyncio.run(run()))
    assert result.final_output == "The sum is 42."
    assert {"response.created", "response.function_call_arguments.delta", "response.output_text.delta", "response.completed"} <= set(kinds)
    calls = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert [c.output for c in calls] == [42]  # the SDK ran the tool on the parsed arguments
    trajectories = scripted.trajectories("agent")  # the SDK sends its history back as returned: one exact trajectory
    assert [t.turns for t in trajectories] == [2], [t.turns for t in trajectories]


async def test_a_streamed_response_is_what_the_same_chat_turn_samples(tiny: OpenAIServer) -> None:
    def talk() -> tuple[list[Any], Any, Any]:
        c = client(tiny, "resp-stream")
        events = list(c.responses.create(model="tiny", instructions="be brief", input="hi", max_output_tokens=6, extra_body={"seed": 5}, stream=True,
                                         include=["message.output_text.logprobs"], top_logprobs=2))
        whole = client(tiny).responses.create(model="tiny", instructions="be brief", input="hi", max_output_tokens=6, extra_body={"seed": 5})
        chat = client(tiny).chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], max_tokens=6, seed=5)
        return events, whole, chat

    events, whole, chat = await in_thread(talk)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text == whole.output_text == chat.choices[0].message.content
    assert done.model_extra["token_ids"] == whole.model_extra["token_ids"] == chat.choices[0].model_extra["token_ids"]
    assert done.model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    logprobs = done.output[0].content[0].logprobs
    assert len(logprobs) == len(done.model_extra["token_ids"]) and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert (done.status == "incomplete") == (len(done.model_extra["token_ids"]) == 6 and done.incomplete_details.reason == "max_output_tokens")
    recorded = tiny.trajectory("resp-stream")
    assert recorded.prompt_ids == done.model_extra["prompt_token_ids"] and recorded.response_ids == done.model_extra["token_ids"]
