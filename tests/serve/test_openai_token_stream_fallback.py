"""The OpenAI server's streaming falls back to chunks of generate_turn calls when the rollout role
declares generate_turn_stream but its engine refuses it (vLLM, the actor's engine): the first
streamed request asks once, is answered in chunks all the same, and later ones do not ask again.
A scripted role (unit test of the server's logic; the real daemon's stream is in
tests/integration/test_openai_token_stream.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from hfrt.control.streams import CallStream
from hfrt.serve.server import OpenAIServer, ServerLimits
from hfrt.wire.errors import RemoteError

pytest.importorskip("openai", reason="the scripted role lives beside the openai client tests")
from tests.integration.test_openai_clients import ScriptedChatRollout  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class RefusingStreams(ScriptedChatRollout):
    """Declares generate_turn_stream, whose calls fail as a vLLM rollout daemon's do."""

    endpoints = {"generate_turn_stream": {"dispatch": "replicate", "concurrent": False, "stream": True}}
    daemons = [SimpleNamespace(rank=0)]

    def __init__(self) -> None:
        super().__init__()
        self.stream_calls = 0
        self.generate_turn_stream = SimpleNamespace(stream=self._stream)

    def _stream(self, rank: int, *args: Any, timeout_s: float | None = None, **options: Any) -> CallStream:
        self.stream_calls += 1
        stream = CallStream()
        stream.future.set_exception(RemoteError("rollout[0].generate_turn_stream", "NotImplementedError", "token streaming needs the HF engine"))
        return stream


async def test_streaming_falls_back_to_chunks_when_the_engine_cannot_stream() -> None:
    rollout = RefusingStreams()
    server = OpenAIServer(rollout, model="scripted", flush_after_s=0.0, limits=ServerLimits(long_request_tokens=10**6))
    assert server.client.can_stream
    for _ in range(2):
        turn = server.completion_turn({"prompt": "<tool>8\n<assistant>", "max_tokens": 40, "stream": True})
        events = [e async for e in server.stream(turn)]
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2])
        assert text == "The sum is 8." and events[-1] == b"data: [DONE]\n\n"
    assert rollout.stream_calls == 1 and not server.client.can_stream and server.token_streams == 0
    assert all(c["max_new_tokens"] <= 4 for c in rollout.calls)  # in chunks of stream_chunk_tokens
