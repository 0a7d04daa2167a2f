"""Real clients against the OpenAI-compatible endpoint over real HTTP: the official `openai` Python
client (chat with tools, a multi-turn tool conversation recorded as one exact trajectory, n=4,
token streaming, top logprobs) and the smolagents ToolCallingAgent running a tool-using agent end
to end, its conversation recorded as a trajectory. The rollout role here is scripted (a random
tiny model cannot write a tool call): it renders chats as `<role>content` lines and answers a
user turn with a Hermes tool call and a tool result with the sum, so what is tested is the
server, the parsers, the sessions and the clients (test_openai_server.py covers the real daemon)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import pytest_asyncio

from hfrt.flows.batches import non_tensor
from hfrt.protocols import BatchHandle
from hfrt.serve.server import OpenAIServer, ServerLimits

openai = pytest.importorskip("openai", reason="the openai client is in the `test` extra (pip install openai)")
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
POOL = ThreadPoolExecutor(max_workers=8)
ADD = {"type": "function", "function": {"name": "add", "description": "add two integers",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def render(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<{m['role']}>{m.get('content') or ''}{''.join(json.dumps(c['function']) for c in m.get('tool_calls') or [])}\n"
                   for m in messages)


class ScriptedChatRollout:
    """generate_turn with ids = character codes: a chat item is rendered by `render` (+ "<assistant>"),
    with `after` only past the held messages; the reply to a user turn calls add on its two numbers,
    the reply to a tool result gives the result."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def reply(self, text: str) -> str:
        tool, user = text.rfind("<tool>"), text.rfind("<user>")
        last = text[max(tool, user):].removesuffix("<tool_call>\n").removesuffix("<assistant>").strip()
        if tool > user:
            return f"The sum is {last[6:]}."
        if last.startswith("<user>Observation:"):  # smolagents reports a tool's result so and ends with final_answer
            call = f'<tool_call>\n{{"name": "final_answer", "arguments": {{"answer": "{last.split()[-1]}"}}}}\n</tool_call>'
            return call.removeprefix("<tool_call>\n") if text.endswith("<tool_call>\n") else call
        a, b = (re.findall(r"\d+", last) + ["2", "3"])[:2]
        call = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        return call.removeprefix("<tool_call>\n") if text.endswith("<tool_call>\n") else call  # after a prefill (tool_choice)

    async def generate_turn(self, handle: BatchHandle, **options: Any) -> BatchHandle:
        self.calls.append(options)
        out: dict[str, list[Any]] = {k: [] for k in ("appended", "turn_ids", "turn_log_probs", "turn_text", "weight_version", "turn_pieces", "turn_top", "turn_finished")}
        for context, append in zip(non_tensor(handle, "context"), non_tensor(handle, "append"), strict=True):
            texts = [render(a["messages"][a.get("after") or 0:]) + "<assistant>" if isinstance(a, dict) else a for a in append]
            full = "".join(chr(t) for t in context) + "".join(texts)
            base = full[: full.rfind("<assistant>") + len("<assistant>")]  # what follows is this turn so far (a prefill, chunks)
            whole = self.reply(base)
            text = whole[len(full) - len(base):][: options["max_new_tokens"]]
            out["turn_finished"].append(len(full) - len(base) + len(text) >= len(whole))
            out["appended"].append([[ord(c) for c in t] for t in texts])
            out["turn_ids"].append([ord(c) for c in text])
            out["turn_log_probs"].append([-0.25] * len(text))
            out["turn_text"].append("".join(chr(t) for t in context[len(context) - options.get("text_prefix", 0):]) + text
                                    if options.get("text_prefix") else text)
            out["weight_version"].append(7)
            out["turn_pieces"].append(list(text) if options.get("pieces") else [])
            out["turn_top"].append([[(ord(c), -0.25), (ord(c) + 1, -2.0)][: options.get("top_logprobs", 0)] for c in text])
        return BatchHandle.inline(out)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[OpenAIServer]:
    limits = ServerLimits(long_request_tokens=10**6)  # the script answers whole turns: no chunked sampling
    async with OpenAIServer(ScriptedChatRollout(), model="scripted", flush_after_s=0.01, api_key="sk-hfrt", limits=limits) as srv:
        yield srv


def client(srv: OpenAIServer) -> Any:
    return openai.OpenAI(base_url=srv.url, api_key="sk-hfrt", max_retries=0)


async def in_thread(fn: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(POOL, fn)


async def test_chat_with_tools_and_a_multi_turn_tool_conversation_is_one_exact_trajectory(server: OpenAIServer) -> None:
    def talk() -> tuple[Any, Any]:
        c = client(server)
        messages: list[Any] = [{"role": "user", "content": "what is 20 + 22?"}]
        first = c.chat.completions.create(model="scripted", messages=messages, tools=[ADD], max_tokens=200,
                                          extra_headers={"X-Session-Id": "calc"})
        call = first.choices[0].message.tool_calls[0]
        result = sum(json.loads(call.function.arguments).values())
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
        second = c.chat.completions.create(model="scripted", messages=messages, tools=[ADD], max_tokens=200,
                                           extra_headers={"X-Session-Id": "calc"})
        return first, second

    first, second = await in_thread(talk)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls[0].function.name == "add" and json.loads(message.tool_calls[0].function.arguments) == {"a": 20, "b": 22}
    assert second.choices[0].message.content == "The sum is 42." and second.choices[0].message.tool_calls is None
    t = server.end_session("calc")
    out1, out2 = first.choices[0].model_extra["token_ids"], second.choices[0].model_extra["token_ids"]
    tool_part = [ord(c) for c in "<tool>42\n<assistant>"]  # only what the template renders past the held tokens
    assert t.prompt_ids == first.model_extra["prompt_token_ids"] and t.turns == 2
    assert t.response_ids == out1 + tool_part + out2 and t.gen_mask == [1] * len(out1) + [0] * len(tool_part) + [1] * len(out2)
    assert second.model_extra["prompt_token_ids"] == t.prompt_ids + out1 + tool_part and t.weight_versions == [7, 7]


async def test_tool_choice_none_and_named_and_unknown_tools(server: OpenAIServer) -> None:
    def ask() -> tuple[Any, Any, Any]:
        c = client(server)
        msgs = [{"role": "user", "content": "1 and 2"}]
        none = c.chat.completions.create(model="scripted", messages=msgs, tools=[ADD], tool_choice="none", max_tokens=200)
        named = c.chat.completions.create(model="scripted", messages=msgs, tools=[ADD], max_tokens=200,
                                          tool_choice={"type": "function", "function": {"name": "add"}})
        try:
            c.chat.completions.create(model="scripted", messages=msgs, tools=[ADD], tool_choice={"type": "function", "function": {"name": "mul"}})
        except openai.BadRequestError as exc:
            return none, named, exc
        raise AssertionError("an unknown tool was accepted")

    none, named, refused = await in_thread(ask)
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content  # not parsed
    assert named.choices[0].message.tool_calls is None or named.choices[0].message.tool_calls[0].function.name == "add"
    assert refused.status_code == 400 and refused.body["param"] == "tool_choice"


async def test_n_streaming_logprobs_and_keys(server: OpenAIServer) -> None:
    def ask() -> tuple[Any, list[Any], Any, Any]:
        c = client(server)
        msgs = [{"role": "tool", "tool_call_id": "x", "content": "9"}]
        four = c.chat.completions.create(model="scripted", messages=msgs, n=4, max_tokens=50, extra_headers={"X-Session-Id": "group"})
        chunks = list(c.chat.completions.create(model="scripted", messages=msgs, max_tokens=50, stream=True,
                                                stream_options={"include_usage": True}))
        lp = c.chat.completions.create(model="scripted", messages=msgs, max_tokens=50, logprobs=True, top_logprobs=2)
        try:
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        except openai.AuthenticationError as exc:
            return four, chunks, lp, exc
        raise AssertionError("a wrong key was accepted")

    four, chunks, lp, denied = await in_thread(ask)
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and all(c.message.content == "The sum is 9." for c in four.choices)
    assert four.usage.completion_tokens == 4 * len("The sum is 9.")
    assert {f"group#{i}" for i in range(4)} <= set(server.sessions)  # each choice its own session branch
    text = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert text == list("The sum is 9.")  # one chunk per token
    assert chunks[-1].usage.completion_tokens == len("The sum is 9.") and chunks[-2].choices[0].finish_reason == "stop"
    content = lp.choices[0].logprobs.content
    assert len(content) == len("The sum is 9.") and all(len(t.top_logprobs) == 2 and t.logprob == -0.25 for t in content)
    assert denied.status_code == 401


@pytest.mark.slow
async def test_a_smolagents_tool_calling_agent_runs_and_its_conversation_is_a_trajectory(server: OpenAIServer) -> None:
    smolagents = pytest.importorskip("smolagents", reason="smolagents is in the `test` extra (pip install smolagents)")

    @smolagents.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return a + b

    def run() -> Any:
        model = smolagents.OpenAIServerModel(model_id="scripted", api_base=server.url, api_key="sk-hfrt",
                                             client_kwargs={"default_headers": {"X-Session-Id": "smol"}, "max_retries": 0})
        agent = smolagents.ToolCallingAgent(tools=[add], model=model, max_steps=3, verbosity_level=0)
        return agent.run("What is 40 + 2?")

    answer = await in_thread(run)
    assert str(answer) == "42"
    # smolagents re-renders its memory each step (tool calls as text, results as user turns), so its
    # calls do not extend each other: each becomes its own exact trajectory
    trajectories = server.trajectories("smol")
    calls = server.sessions["smol"].calls
    assert len(trajectories) == len(calls) == 2 and [t.turns for t in trajectories] == [1, 1]
    for t, call in zip(trajectories, calls, strict=True):
        assert t.prompt_ids == call.prompt_ids and t.response_ids == call.output_ids and t.gen_mask == [1] * len(call.output_ids)
    assert "final_answer" in "".join(chr(i) for i in trajectories[-1].response_ids)


async def test_a_streamed_turn_is_sent_as_it_is_sampled_and_recorded_whole(server: OpenAIServer) -> None:
    rollout = server.rollout
    before = len(rollout.calls)

    def ask() -> list[Any]:
        stream = client(server).completions.create(model="scripted", prompt="<tool>8\n<assistant>", max_tokens=40, stream=True,
                                                   extra_headers={"X-Session-Id": "streamed"}, logprobs=0)
        return list(stream)

    chunks = await in_thread(ask)
    text = "The sum is 8."
    assert "".join(c.choices[0].text for c in chunks) == text and len(chunks) == len(text) + 1  # a chunk per token, then finish
    assert len(rollout.calls) - before == 4  # 4 tokens per generate_turn call: sent as sampled, not after the whole turn
    assert all(c["max_new_tokens"] <= 4 for c in rollout.calls[before:])
    session = server.sessions["streamed"].calls[-1]
    assert session.output_ids == [ord(c) for c in text] and session.log_probs == [-0.25] * len(text)
