"""Agent frameworks from PyPI against `hfrt serve-openai`'s server on a real rollout daemon (the
tiny preset, random weights, its context widened to 2,048 tokens for the frameworks' schemas):
the OpenAI Agents SDK with its default (Responses) model — a function tool, streamed, and
`output_type=` a pydantic model —, LangChain's `with_structured_output` (its default method), a
ReAct prompt with `stop=["Observation:"]`, and the built-in Hermes tool template. A random model
writes valid calls and answers only because the server constrains them (structured output, forced
strict calls); that is what these tests hold."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest
import pytest_asyncio
from pydantic import BaseModel

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.serve.server import OpenAIServer
from tests.integration.test_openai_clients import POOL
from tests.support import local_cluster

openai = pytest.importorskip("openai", reason="the openai client is in the `test` extra")
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
ADD = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}}}


class Answer(BaseModel):
    """What the agent answers: bounded fields, so a random model's constrained answer ends."""

    sum: int
    op: Literal["add", "mul"]
    sure: bool


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hfrt.roles.models import build_tiny

    model, tokenizer = build_tiny(0)
    model.config.max_position_embeddings = 2048
    folder = tmp_path_factory.mktemp("tiny2k")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def decode(long_tiny: Path) -> Any:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(long_tiny / "tokenizer.json"))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctl(long_tiny: Path) -> AsyncIterator[Any]:
    async with local_cluster([DaemonSpec("rollout", impl="rollout", options={"model": str(long_tiny), "seed": 0})]) as (controller, _):
        yield controller


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ctl: Any) -> AsyncIterator[OpenAIServer]:
    rollout = await ctl.role("rollout", timeout_s=90)
    async with OpenAIServer(rollout, model="tiny", flush_after_s=0.01, timeout_s=120) as srv:
        yield srv


#: the async clients sdk_model made in the running in_loop call, closed before its loop ends (one
#: left open is closed by the garbage collector later, on a closed loop, and logs an error into
#: whichever test runs then)
_CLIENTS: list[Any] = []


def in_loop(coro_fn: Any) -> Any:
    """Run an async client in a thread with its own event loop (the server runs in the test's)."""
    async def closing() -> Any:
        try:
            return await coro_fn()
        finally:
            while _CLIENTS:
                await _CLIENTS.pop().close()

    return asyncio.get_running_loop().run_in_executor(POOL, lambda: asyncio.run(closing()))


def sdk_model(srv: OpenAIServer, session: str) -> Any:
    import agents

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=srv.url, api_key="unused", max_retries=0, default_headers={"X-Session-Id": session})
    _CLIENTS.append(client)
    return agents.OpenAIResponsesModel("tiny", client)


async def test_the_agents_sdk_calls_a_function_tool_streamed(server: OpenAIServer) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the `test` extra")
    ran: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    async def run() -> tuple[Any, list[str]]:
        agent = agents.Agent(name="calc", instructions="Add with the tool, then answer.", tools=[add], output_type=Answer,
                             model=sdk_model(server, "sdk-tool"), model_settings=agents.ModelSettings(tool_choice="required"))
        result = agents.Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
        kinds = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
        return result, kinds

    result, kinds = await in_loop(run)
    assert len(ran) == 1 and all(type(v) is int for v in ran[0]), ran  # the strict call parsed and the SDK ran it
    assert {"response.function_call_arguments.delta", "response.output_text.delta", "response.completed"} <= set(kinds), kinds
    assert isinstance(result.final_output, Answer)  # after the call the tool choice is back to auto: the JSON answer
    assert sum(t.turns for t in server.trajectories("sdk-tool")) == 2


async def test_the_agents_sdk_output_type_is_a_pydantic_model(server: OpenAIServer, decode: Any) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the `test` extra")

    async def run() -> Any:
        agent = agents.Agent(name="calc", instructions="Answer as JSON.", output_type=Answer, model=sdk_model(server, "sdk-json"))
        return await agents.Runner.run(agent, "What is 2 + 3?", max_turns=1)

    result = await in_loop(run)
    assert isinstance(result.final_output, Answer), result.final_output
    [call] = server.sessions["sdk-json"].calls  # recorded: the sampled ids are the answer's JSON
    assert Answer.model_validate(json.loads(decode(call.output_ids))) == result.final_output


async def test_langchain_with_structured_output_by_its_default_method(server: OpenAIServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the `test` extra")

    def run() -> Any:
        llm = langchain_openai.ChatOpenAI(model="tiny", base_url=server.url, api_key="unused", max_retries=0, temperature=1.0)
        return llm.with_structured_output(Answer).invoke("What is 2 + 3?")

    answer = await asyncio.get_running_loop().run_in_executor(POOL, run)
    assert isinstance(answer, Answer), answer


async def test_a_react_prompt_stops_at_observation(server: OpenAIServer, decode: Any) -> None:
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the `test` extra")
    react = ("Answer with Thought, Action, Action Input, then wait for the Observation.\n"
             "Tools: add(a, b).\nQuestion: What is 2 + 3?")
    # a random model stands in for one that writes a ReAct step: its text is held to one (a JSON string) by a grammar
    step = "Thought: I should add. Action: add Action Input: 2, 3 Observation: 5 Thought: done"

    def run() -> Any:
        llm = langchain_openai.ChatOpenAI(model="tiny", base_url=server.url, api_key="unused", max_retries=0,
                                          default_headers={"X-Session-Id": "react"})
        bound = llm.bind(stop=["Observation:"], response_format={"type": "json_schema", "json_schema": {
            "name": "step", "schema": {"enum": [step]}}})
        return bound.invoke(react)

    message = await asyncio.get_running_loop().run_in_executor(POOL, run)
    assert message.content == '"Thought: I should add. Action: add Action Input: 2, 3 ', message.content
    assert message.response_metadata["finish_reason"] == "stop"
    [call] = server.sessions["react"].calls  # the ids keep the tokens that spelled the stop string
    assert decode(call.output_ids).endswith("Observation:")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hermes(ctl: Any) -> AsyncIterator[OpenAIServer]:
    rollout = await ctl.role("rollout", timeout_s=90)
    async with OpenAIServer(rollout, model="tiny", flush_after_s=0.01, timeout_s=120, tool_template="hermes") as srv:
        yield srv


async def test_the_hermes_tool_template_shows_the_model_its_tools_and_a_round_trip_stays_exact(hermes: OpenAIServer, decode: Any) -> None:
    def talk() -> tuple[Any, Any]:
        c = openai.OpenAI(base_url=hermes.url, api_key="unused", max_retries=0, default_headers={"X-Session-Id": "hermes"})
        messages: list[Any] = [{"role": "user", "content": "2+3"}]
        first = c.chat.completions.create(model="tiny", messages=messages, tools=[ADD], tool_choice="required")
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        return first, c.chat.completions.create(model="tiny", messages=messages, tools=[ADD], max_tokens=3)

    first, second = await asyncio.get_running_loop().run_in_executor(POOL, talk)
    prompt = decode(first.model_extra["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "add"' in prompt and prompt.endswith("<|im_start|>assistant\n<tool_call>\n")
    assert "<tool_response>\n5\n</tool_response>" in decode(second.model_extra["prompt_token_ids"])
    [t] = hermes.trajectories("hermes")  # the session continued from its exact ids through the template
    assert t.turns == 2 and t.response_ids[:len(first.choices[0].model_extra["token_ids"])] == first.choices[0].model_extra["token_ids"]
