"""The OpenAI-compatible endpoint on a real rollout daemon (tiny preset, given a chat template) over
real HTTP (urllib in threads): completions from text and from token ids, chat completions,
concurrent clients batched into fewer generate_turn calls, bad requests refused with the field
named while the server serves on, sessions that build exact trajectories, and drift detected."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.flows.agent.loop import assemble
from hfrt.flows.agent.openai.server import OpenAIServer
from hfrt.flows.agent.openai.sessions import SessionDrift
from tests.support import local_cluster

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

#: a minimal chat template for the tiny preset (which has none)
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
POOL = ThreadPoolExecutor(max_workers=16)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset's files with a chat template added to its tokenizer config."""
    from hfrt.roles.models import resolve_model_dir

    source, folder = resolve_model_dir("tiny", 0), tmp_path_factory.mktemp("tiny-chat")
    for item in source.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctl(chat_model: Path) -> AsyncIterator[Any]:
    specs = [DaemonSpec("rollout", impl="rollout", options={"model": str(chat_model), "seed": 0})]
    async with local_cluster(specs) as (controller, _):
        yield controller


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ctl: Any) -> AsyncIterator[OpenAIServer]:
    rollout = await ctl.role("rollout", timeout_s=90)
    async with OpenAIServer(rollout, model="tiny", flush_after_s=0.3, batch_size=8, timeout_s=60) as srv:
        yield srv


@pytest.fixture(scope="module")
def decode(chat_model: Path) -> Iterator[Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    yield lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def encode(chat_model: Path) -> Iterator[Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    yield lambda text: tok.encode(text, add_special_tokens=False).ids


def _http(url: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def call(srv: OpenAIServer, path: str, body: Any = None, **headers: str) -> tuple[int, dict[str, Any]]:
    """One request from a client thread (a real HTTP client on a real socket)."""
    return await asyncio.get_running_loop().run_in_executor(POOL, _http, srv.url + path, body, headers)


async def test_models_and_text_completion(server: OpenAIServer, decode: Any) -> None:
    status, models = await call(server, "/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    status, out = await call(server, "/completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 6, "logprobs": 1, "seed": 3})
    assert status == 200, out
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and out["prompt_token_ids"] == [ord(c) - 30 for c in "1+1="]
    assert 1 <= len(choice["token_ids"]) <= 6 and decode(choice["token_ids"]) == choice["text"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(choice["token_ids"]) and all(lp <= 0.0 for lp in logprobs)
    assert choice["finish_reason"] in ("stop", "length") and out["weight_version"] == -1
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": len(choice["token_ids"]), "total_tokens": 4 + len(choice["token_ids"])}


async def test_token_id_completion_continues_exactly(server: OpenAIServer, decode: Any) -> None:
    ids = [ord(c) - 30 for c in "2+3="]
    status, out = await call(server, "/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert status == 200, out
    choice = out["choices"][0]
    assert out["prompt_token_ids"] == ids and decode(choice["token_ids"]) == choice["text"]
    assert choice["logprobs"] is None  # not asked for
    again = (await call(server, "/completions", {"prompt": [ids], "max_tokens": 4, "temperature": 0}))[1]
    assert again["choices"][0]["token_ids"] == choice["token_ids"]  # greedy: the same tokens


async def test_chat_completion_uses_the_daemons_chat_template(server: OpenAIServer, decode: Any, encode: Any) -> None:
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": [{"type": "text", "text": "1+2="}]}]
    status, out = await call(server, "/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 5, "logprobs": True})
    assert status == 200, out
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert out["prompt_token_ids"] == encode("<system>add\n<user>1+2=\n<assistant>")
    assert decode(choice["token_ids"]) == choice["message"]["content"]
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]


async def test_concurrent_clients_are_batched(server: OpenAIServer) -> None:
    before = server.generate_calls
    bodies = [{"prompt": f"{i}+{i}=", "max_tokens": 3} for i in range(8)]
    replies = await asyncio.gather(*(call(server, "/completions", b) for b in bodies))
    assert all(status == 200 for status, _ in replies), replies
    assert [r["prompt_token_ids"] for _, r in replies] == [[ord(c) - 30 for c in b["prompt"]] for b in bodies]
    assert server.generate_calls - before < 8  # 8 requests, fewer calls (typically 1)


async def test_bad_requests_name_the_field_and_the_server_serves_on(server: OpenAIServer) -> None:
    cases = [
        ({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": 5}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "stop": "\n\n"}, "stop"),  # two tokens: refused by the rollout daemon
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ]
    for body, field in cases:
        status, out = await call(server, "/completions", body)
        assert status == 400 and out["error"]["param"] == field, (body, out)
    status, out = await call(server, "/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]})
    assert status == 400 and out["error"]["param"] == "messages[0].role"
    status, out = await call(server, "/completions", {"prompt": "x", "model": "gpt-4"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    status, out = await call(server, "/nowhere", {"prompt": "x"})
    assert status == 404 and "/v1/completions" in out["error"]["message"]
    # one bad row in a batch: its own 500, the others batched with it are served
    bodies = [{"prompt": [40, 41], "max_tokens": 2}] * 3 + [{"prompt": [10**6], "max_tokens": 2}]
    replies = await asyncio.gather(*(call(server, "/completions", b) for b in bodies))
    assert [status for status, _ in replies] == [200, 200, 200, 500], replies
    assert "generate_turn failed" in replies[3][1]["error"]["message"]
    assert (await call(server, "/completions", {"prompt": "ok", "max_tokens": 2}))[0] == 200


async def test_session_builds_an_exact_trajectory(server: OpenAIServer, ctl: Any) -> None:
    # text prompts: the second starts with the first prompt + the returned text, so only "[42]" is tokenised
    first = (await call(server, "/completions", {"prompt": "1+1=", "max_tokens": 4, "user": "text"}))[1]
    text = "1+1=" + first["choices"][0]["text"] + "[42]"
    second = (await call(server, "/completions", {"prompt": text, "max_tokens": 3, "logprobs": 0, "user": "text"}))[1]
    # token-id prompts: the client keeps the prefix exact itself
    a = (await call(server, "/completions", {"prompt": [40, 41], "max_tokens": 4, "logprobs": 0}, **{"X-Session-Id": "ids"}))[1]
    held = a["prompt_token_ids"] + a["choices"][0]["token_ids"]
    b = (await call(server, "/completions", {"prompt": held + [60, 61], "max_tokens": 3, "logprobs": 0}, **{"X-Session-Id": "ids"}))[1]
    for name, one, two, extra in (("text", first, second, [ord(c) - 30 for c in "[42]"]), ("ids", a, b, [60, 61])):
        t1, t2 = one["choices"][0]["token_ids"], two["choices"][0]["token_ids"]
        t = server.trajectory(name)
        assert t.prompt_ids == one["prompt_token_ids"] and t.turns == 2 and t.sample == {"session": name}
        assert t.response_ids == t1 + extra + t2
        assert two["prompt_token_ids"] == t.prompt_ids + t1 + extra
        assert t.gen_mask == [1] * len(t1) + [0] * len(extra) + [1] * len(t2)
        assert t.log_probs[len(t1) + len(extra):] == two["choices"][0]["logprobs"]["token_logprobs"]
        assert t.weight_versions == [-1, -1]
    trajectories = [server.end_session(name) for name in ("text", "ids")]
    batch = await ctl.fetch(await assemble(server.rollout, trajectories))  # the rollout batch the actor trains on
    assert not server.sessions or not {"text", "ids"} & set(server.sessions)
    for row, t in enumerate(trajectories):
        n = len(t.response_ids)
        assert batch["responses"][row, :n].tolist() == t.response_ids and batch["response_mask"][row, :n].tolist() == t.gen_mask
        assert batch["rollout_log_probs"][row, :n].tolist() == pytest.approx(t.log_probs)


async def test_session_drift_is_detected(server: OpenAIServer) -> None:
    await call(server, "/completions", {"prompt": [40, 41, 42], "max_tokens": 2}, **{"X-Session-Id": "drift"})
    await call(server, "/completions", {"prompt": [40, 41, 43, 44], "max_tokens": 2}, **{"X-Session-Id": "drift"})
    with pytest.raises(SessionDrift, match=r"session 'drift': call 1.*first difference at token 2"):
        server.trajectory("drift")


async def test_the_openai_client_library_works_against_it(server: OpenAIServer) -> None:
    try:
        import openai
    except ImportError:
        pytest.skip("the openai package is not installed (pip install openai to run this check)")

    def use_client() -> tuple[Any, list[Any]]:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        done = client.completions.create(model="tiny", prompt="1+1=", max_tokens=3, logprobs=1)
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True, stream_options={"include_usage": True}))
        return done, chunks

    done, chunks = await asyncio.get_running_loop().run_in_executor(POOL, use_client)
    assert done.choices[0].text is not None and len(done.choices[0].logprobs.token_logprobs) == done.usage.completion_tokens
    assert done.model_extra is not None and len(done.model_extra["prompt_token_ids"]) == 4  # the extension fields reach the client
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.prompt_tokens == len(chunks[0].model_extra["prompt_token_ids"])
    assert chunks[1].choices[0].finish_reason in ("stop", "length")
