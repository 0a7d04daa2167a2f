"""Token-by-token streaming from a real rollout daemon (the tiny preset, HF engine) through the
OpenAI-compatible server: the official `openai` client receives one chunk per token from one
generate_turn_stream call (one prefill, the KV cache kept for the turn); the recorded session is
token-exact, the same ids and log-probs as the non-streamed request with the same seed; a client
that disconnects mid-stream stops the daemon's sampling; a short request is answered within a
second while a long stream runs. The daemon samples with ignore_eos, so every turn runs to its
max_tokens (the random tiny model would otherwise end turns at an early eos)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import pytest_asyncio

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.serve.server import OpenAIServer
from tests.support import local_cluster

openai = pytest.importorskip("openai", reason="the openai client is in the `test` extra (pip install openai)")
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
POOL = ThreadPoolExecutor(max_workers=4)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[OpenAIServer]:
    from hfrt.roles.models import resolve_model_dir

    options = {"model": str(resolve_model_dir("tiny", 0)), "seed": 0, "sampling": {"ignore_eos": True}}
    async with local_cluster([DaemonSpec("rollout", impl="rollout", options=options)]) as (ctl, _):
        rollout = await ctl.role("rollout", timeout_s=90)
        async with OpenAIServer(rollout, model="tiny", flush_after_s=0.005, timeout_s=60) as srv:
            yield srv


def client(srv: OpenAIServer) -> Any:
    return openai.OpenAI(base_url=srv.url, api_key="sk-none", max_retries=0)


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(POOL, fn, *args)


async def test_the_openai_client_gets_a_chunk_per_token_and_the_session_is_exact(server: OpenAIServer) -> None:
    calls, streams = server.generate_calls, server.token_streams
    request = {"model": "tiny", "prompt": "12+30=", "max_tokens": 24, "seed": 7, "temperature": 1.0, "logprobs": 0}

    def ask() -> tuple[list[Any], list[float], Any]:
        stream = client(server).completions.create(**request, stream=True, extra_headers={"X-Session-Id": "streamed"}, stream_options={"include_usage": True})
        chunks, arrived = [], []
        for chunk in stream:
            chunks.append(chunk)
            arrived.append(time.perf_counter())
        whole = client(server).completions.create(**request, extra_headers={"X-Session-Id": "whole"})
        return chunks, arrived, whole

    chunks, arrived, whole = await in_thread(ask)
    tokens = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(tokens) == 24 and all(len(c.choices[0].model_extra["token_ids"]) == 1 for c in tokens)  # a chunk per token
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-2].choices[0].finish_reason == "length"
    streamed_ids = [c.choices[0].model_extra["token_ids"][0] for c in tokens]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]  # the same seed samples the same turn
    assert "".join(c.choices[0].text for c in tokens) == whole.choices[0].text
    assert [c.choices[0].logprobs.token_logprobs[0] for c in tokens] == whole.choices[0].logprobs.token_logprobs
    # one generate_turn_stream call for the streamed turn, one generate_turn call for the whole one
    assert server.token_streams == streams + 1 and server.generate_calls == calls + 1
    a, b = server.sessions["streamed"].calls[-1], server.sessions["whole"].calls[-1]
    assert (a.prompt_ids, a.output_ids, a.log_probs) == (b.prompt_ids, b.output_ids, b.log_probs)  # token-exact recording
    assert a.prompt_ids == tokens[0].model_extra["prompt_token_ids"]
    gaps = [t1 - t0 for t0, t1 in zip(arrived, arrived[1:len(tokens)], strict=False)]
    print(f"24 tokens streamed; median gap between token chunks {sorted(gaps)[len(gaps) // 2] * 1e3:.1f} ms")

    def chat() -> tuple[list[Any], Any]:
        msgs = [{"role": "user", "content": "hi"}]
        ask = {"model": "tiny", "messages": msgs, "max_tokens": 12, "seed": 3, "logprobs": True, "top_logprobs": 2}
        return list(client(server).chat.completions.create(**ask, stream=True)), client(server).chat.completions.create(**ask)

    parts, whole_chat = await in_thread(chat)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole_chat.choices[0].message.content
    streamed_lp = [t for c in parts if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed_lp] == [t.logprob for t in whole_chat.choices[0].logprobs.content] and len(streamed_lp) == 12
    # the top 2 at each step, from the step's own logits (the whole turn's come from one forward pass: equal to float noise)
    for s, w in zip(streamed_lp, whole_chat.choices[0].logprobs.content, strict=True):
        assert len(s.top_logprobs) == 2 and max(a.logprob for a in s.top_logprobs) >= s.logprob - 1e-4
        assert [a.token for a in s.top_logprobs] == [a.token for a in w.top_logprobs]
    assert server.token_streams == streams + 2


async def test_a_refused_streamed_request_gets_a_json_400_naming_the_field(server: OpenAIServer) -> None:
    for body, param in (({"prompt": [1000000], "max_tokens": 4}, "prompt"), ({"prompt": "hi", "max_tokens": 4, "logit_bias": {"99999": 1}}, "logit_bias")):
        status, reply = await in_thread(_post_json, server.url + "/completions", {**body, "stream": True})
        assert status == 400 and reply["error"]["param"] == param, reply


def _post_json(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return int(reply.status), {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _open_stream(srv: OpenAIServer, body: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    data = json.dumps({**body, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return reader, writer


async def test_a_client_that_disconnects_stops_the_daemons_sampling(server: OpenAIServer) -> None:
    rollout = server.rollout
    before = await rollout.turn_streams.call_one(0)
    reader, writer = await _open_stream(server, {"prompt": "tell me", "max_tokens": 400, "temperature": 1.0})
    events = 0
    while events < 5:  # a few tokens in, then the client goes away
        line = await reader.readline()
        events += line.startswith(b"data: ")
    writer.close()
    deadline = time.monotonic() + 10
    while (stats := await rollout.turn_streams.call_one(0))["open"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    after = await rollout.turn_streams.call_one(0)
    sampled = after["tokens"] - before["tokens"]
    assert stats["open"] == 0 and after["closed_early"] == before["closed_early"] + 1, (before, after)
    assert after["tokens"] == stats["tokens"] and sampled < 400, (sampled, after)  # stopped, and well before its 400 tokens
    print(f"the daemon sampled {sampled} of 400 tokens before it stopped")


async def test_a_short_request_is_answered_within_a_second_while_a_long_stream_runs(server: OpenAIServer) -> None:
    start = time.monotonic()
    reader, writer = await _open_stream(server, {"prompt": "7" * 100, "max_tokens": 400, "temperature": 1.0})
    try:
        await reader.readuntil(b"data: ")  # the long stream's first token
        first_token_s = time.monotonic() - start
        short = time.monotonic()
        status = await in_thread(_post, server.url + "/completions", {"prompt": "1+1=", "max_tokens": 4})
        waited = time.monotonic() - short
        assert status == 200
        print(f"long stream: first token after {first_token_s:.2f} s; the short request waited {waited:.2f} s "
              f"(load {os.getloadavg()[0]:.1f})")
        # a short call runs between two of the stream's decode steps: 1 s on a quiet machine, looser on a loaded one
        assert waited < (1.0 if os.getloadavg()[0] < 3 else 5.0), waited
        body = await reader.read(1 << 16)
        assert b"data: " in body  # still streaming after the short one was answered
    finally:
        writer.close()


def _post(url: str, body: dict[str, Any]) -> int:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as reply:
        reply.read()
        return int(reply.status)
