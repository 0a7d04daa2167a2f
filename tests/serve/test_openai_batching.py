"""How the OpenAI endpoint batches and maps failures, on a scripted rollout role (pure logic):
TurnBatcher's batch_size and idle_flush modes, a failed batch retried one request at a time, and
generate_turn errors as 400 (input refused), 503 (daemon gone) or 500 without server details."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hfrt.serve.api import ApiError, BadRequest
from hfrt.serve.rollout import http_error
from hfrt.serve.server import OpenAIServer
from hfrt.serve.turns import AgentGenerationError, TurnBatcher
from hfrt.wire.errors import DaemonGone, RemoteError
from tests.flows.test_agent_loop import ScriptedRollout

OPTIONS = {"max_new_tokens": 2, "temperature": 1.0, "stop": []}


class SlowRollout(ScriptedRollout):
    """Takes `delay_s` per call; a row whose context is [999] makes its whole call fail."""

    def __init__(self, delay_s: float = 0.05) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def generate_turn(self, handle: Any, **options: Any) -> Any:
        await asyncio.sleep(self.delay_s)
        from hfrt.flows.batches import non_tensor

        if [999] in non_tensor(handle, "context"):
            self.calls.append(options | {"rows": len(non_tensor(handle, "context"))})
            raise RemoteError("rollout:0", "IndexError", "index out of range in self")
        return await super().generate_turn(handle, **options)


async def test_batch_size_sends_a_full_round_at_once_and_the_timer_the_rest() -> None:
    rollout = SlowRollout(0.0)
    batcher = TurnBatcher(rollout, flush_after_s=0.2, batch_size=3)
    start = asyncio.get_running_loop().time()
    await asyncio.gather(*(batcher.request([i], [], OPTIONS) for i in range(3)))
    assert asyncio.get_running_loop().time() - start < 0.15 and [c["rows"] for c in rollout.calls] == [3]
    await asyncio.gather(*(batcher.request([i], [], OPTIONS) for i in range(2)))  # not full: after flush_after_s
    assert asyncio.get_running_loop().time() - start >= 0.2 and [c["rows"] for c in rollout.calls] == [3, 2]


async def test_idle_flush_sends_at_once_and_groups_what_comes_meanwhile() -> None:
    rollout = SlowRollout(0.05)
    batcher = TurnBatcher(rollout, flush_after_s=10.0, batch_size=64, idle_flush=True)
    first = asyncio.ensure_future(batcher.request([1], [], OPTIONS))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(batcher.request([i], [], OPTIONS)) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(first, *rest), 2.0)  # never waits for the 10 s timer
    assert [c["rows"] for c in rollout.calls] == [1, 4] and batcher.in_flight == 0


async def test_one_bad_request_fails_alone_and_the_others_are_served() -> None:
    rollout = SlowRollout(0.0)
    server = OpenAIServer(rollout, batch_size=4, flush_after_s=0.05)
    bodies = [{"prompt": [40], "max_tokens": 2}] * 3 + [{"prompt": [999], "max_tokens": 2}]

    async def post(body: dict[str, Any]) -> Any:
        try:
            await server.complete(server.completion_turn(body))
            return 200
        except Exception as exc:
            return exc

    results = await asyncio.gather(*(post(b) for b in bodies))
    assert results[:3] == [200, 200, 200] and getattr(results[3], "status", None) == 500
    assert "rollout:0 raised IndexError" in results[3].message and "index out of range" not in results[3].message
    assert [c["rows"] for c in rollout.calls] == [4, 1, 1, 1, 1] and server.generate_calls == 5


def test_generation_errors_become_http_statuses() -> None:
    """A refusal's HTTP fields come from its param and type, never its words (docs/agents-and-openai.md)."""

    def failed(cause: Exception) -> AgentGenerationError:
        error = AgentGenerationError("generate_turn on the rollout role failed for 1 conversations")
        error.rows, error.__cause__ = 1, cause
        return error

    refused = http_error(failed(RemoteError("rollout:0", "InvalidArgument", "generate_turn: stop must be a table, not 'x'", param="stop")))
    assert isinstance(refused, BadRequest) and refused.status == 400 and refused.param == "stop"
    unnamed = http_error(failed(RemoteError("rollout:0", "ValueError", "generate_turn row 0: stop string '\\n\\n' is 2 tokens")))
    assert unnamed.status == 400 and unnamed.param is None  # a refusal is not guessed from its words
    gone = http_error(failed(DaemonGone("rollout:0 exited; its log: /runs/x/rollout-0.log (last lines: ...)")))
    assert gone.status == 503 and "/runs/" not in gone.message and "log:" not in gone.message and "incident" in gone.message
    crashed = http_error(failed(RemoteError("rollout:0", "RuntimeError", "CUDA error at /src/x.py", "Traceback ...")))
    assert crashed.status == 500 and "Traceback" not in crashed.message and "/src/" not in crashed.message
    assert "rollout:0 raised RuntimeError" in crashed.message
    vocab = http_error(failed(RemoteError("rollout:0", "InvalidArgument", "generate_turn row 0: prompt: token id 9 is outside the vocabulary",
                                          param="prompt")), "chat")
    assert vocab.status == 400 and vocab.param == "messages" and vocab.code is None
    assert vocab.message == "messages: the rollout daemon refused the request: token id 9 is outside the vocabulary"
    long = http_error(failed(RemoteError("rollout:0", "ContextTooLong", "generate_turn row 0: prompt: the model's context is 8 tokens",
                                         param="prompt")))
    assert (long.status, long.param, long.code) == (400, "prompt", "context_length_exceeded")


async def test_sessions_are_recorded_and_the_oldest_dropped_past_max_sessions() -> None:
    server = OpenAIServer(SlowRollout(0.0), batch_size=1, max_sessions=2)
    with pytest.raises(ApiError, match="IndexError"):
        await server.complete(server.completion_turn({"prompt": [999], "max_tokens": 2}), "failed")
    assert "failed" not in server.sessions  # a session records a call once it succeeded
    for name in ("a", "b", "c"):
        await server.complete(server.completion_turn({"prompt": "hi", "max_tokens": 2}), name)
    assert list(server.sessions) == ["b", "c"] and server.sessions_dropped == 1
    # `user` is attribution only: it neither opens nor continues a session
    await server.complete(server.completion_turn({"prompt": "hiab!", "max_tokens": 2, "user": "c"}))
    assert list(server.sessions) == ["b", "c"] and len(server.sessions["c"].calls) == 1
    # "hi" + the returned "ab" + new text, under the session's key
    await server.complete(server.completion_turn({"prompt": "hiab!", "max_tokens": 2, "user": "someone"}), "c")
    t = server.end_session("c")
    assert t.prompt_ids == [ord("h"), ord("i")] and t.response_ids == [ord(c) for c in "ab!ab"] and t.gen_mask == [1, 1, 0, 1, 1]
    assert list(server.sessions) == ["b"]


def test_the_server_side_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, hfrt.serve.server, hfrt.serve.app, hfrt.cli\nassert 'torch' not in sys.modules, 'torch was imported'\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_constrained_turn_is_never_sampled_in_chunks() -> None:
    server = OpenAIServer(SlowRollout(0.0))
    long = server.chat_turn({"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 100})
    assert server._options(long, [], long.append)[1] is server.client.long  # a long turn: chunks, so short ones pass it
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    constrained = server.chat_turn({"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 100, "response_format": schema})
    assert server._options(constrained, [], constrained.append)[1] is server.client.batcher  # one call: a grammar cannot resume mid-turn
