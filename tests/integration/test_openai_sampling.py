"""Sampling options of the OpenAI-compatible endpoint on a real rollout daemon (tiny preset, HF
engine; its tokenizer spells character c as token ord(c) - 30): stop strings of any length at
the text level (the ids keep the tokens that spelled the stop, the text ends before it, streamed
or not), logit_bias, and presence / frequency penalties — and the log-probs recorded are those of
the shaped distribution the tokens were sampled from."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from hfrt.serve.server import OpenAIServer
from tests.integration.test_openai_server import POOL, call, chat_model, ctl, decode  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


def tok(c: str) -> str:
    """The tiny vocabulary's id of character `c`, as logit_bias keys it."""
    return str(ord(c) - 30)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ctl: Any) -> AsyncIterator[OpenAIServer]:  # noqa: F811
    rollout = await ctl.role("rollout", timeout_s=90)
    async with OpenAIServer(rollout, model="tiny", flush_after_s=0.01, timeout_s=60) as srv:
        yield srv


async def test_a_multi_token_stop_string_ends_the_turn_at_the_text_level(server: OpenAIServer, decode: Any) -> None:  # noqa: F811 (the fixture)
    # only "a" and "b" can be sampled (each +100): "ab" comes within a few tokens and ends the turn
    body = {"prompt": "1+1=", "max_tokens": 200, "logit_bias": {tok("a"): 100, tok("b"): 100}, "stop": ["ab", "never"], "seed": 1,
            "logprobs": 2}
    status, out = await call(server, "/completions", body, **{"X-Session-Id": "react"})
    assert status == 200, out
    choice = out["choices"][0]
    spelled = decode(choice["token_ids"])
    assert choice["finish_reason"] == "stop" and spelled.endswith("ab") and "ab" not in spelled[:-1]
    assert choice["text"] == spelled[:-2] and set(choice["text"]) <= {"a", "b"}  # the stop text is not returned
    # the shaped distribution is what was sampled from: the two tokens at +100 share all of it
    for lp, top in zip(choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"], strict=True):
        assert set(top) == {f"token_id:{tok('a')}", f"token_id:{tok('b')}"} and abs(sum(math.exp(v) for v in top.values()) - 1) < 1e-4
        assert any(abs(lp - v) < 1e-5 for v in top.values()), (lp, top)
    # the session holds the ids as sampled; a next prompt that spells the stop continues them exactly
    first = out["prompt_token_ids"] + choice["token_ids"]
    status, out2 = await call(server, "/completions", {"prompt": "1+1=" + choice["text"] + "ab" + "7", "max_tokens": 2},
                              **{"X-Session-Id": "react"})
    assert status == 200 and out2["prompt_token_ids"] == first + [int(tok("7"))], (out2["prompt_token_ids"], first)
    kept = dict(body, include_stop_str_in_output=True)
    status, out = await call(server, "/completions", kept)
    assert status == 200 and out["choices"][0]["text"].endswith("ab") and out["choices"][0]["text"] == decode(out["choices"][0]["token_ids"])


async def test_a_streamed_turn_never_shows_the_stop_text(server: OpenAIServer) -> None:
    import urllib.request

    body = {"prompt": "1+1=", "max_tokens": 200, "logit_bias": {tok("a"): 100, tok("b"): 100}, "stop": "ab", "seed": 3, "stream": True}
    whole = dict(body, stream=False)

    def stream() -> list[dict[str, Any]]:
        req = urllib.request.Request(server.url + "/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as reply:
            return [json.loads(line[6:]) for line in reply.read().decode().split("\n\n") if line.startswith("data: {")]

    import asyncio

    chunks = await asyncio.get_running_loop().run_in_executor(POOL, stream)
    status, out = await call(server, "/completions", whole)
    assert status == 200
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == out["choices"][0]["text"] and "ab" not in text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == ["stop"]


async def test_logit_bias_and_penalties_shape_what_is_sampled(server: OpenAIServer) -> None:
    greedy = {"prompt": "1+1=", "max_tokens": 12, "temperature": 0, "logit_bias": {tok("z"): 10}}
    status, plain = await call(server, "/completions", greedy)
    assert status == 200 and plain["choices"][0]["text"] == "z" * 12, plain["choices"][0]["text"]
    status, present = await call(server, "/completions", dict(greedy, presence_penalty=2.0, logit_bias={tok("z"): 1.5}))
    assert status == 200 and present["choices"][0]["text"].count("z") <= 1, present["choices"][0]["text"]
    status, frequent = await call(server, "/completions", dict(greedy, frequency_penalty=2.0))
    text = frequent["choices"][0]["text"]
    assert status == 200 and 1 <= text.count("z") < 12, text  # z until its count times 2 outweighs its bias of 10
    status, out = await call(server, "/completions", dict(greedy, logit_bias={"99999": 1}))
    assert status == 400 and out["error"]["param"] == "logit_bias" and "token id 99999 is outside the vocabulary" in out["error"]["message"]
