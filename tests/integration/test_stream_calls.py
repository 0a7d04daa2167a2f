"""Streaming endpoints on a real daemon process (the echo role's `count`): each yielded value
arrives as a Partial before the Reply, in order and while the generator still runs; an ordered call
runs between two steps; closing the stream early stops the daemon's generator (its `finally` runs,
no more values come); an error after some values reaches both the iteration and `result()`; a
stream's timeout bounds each wait between its messages, not its whole length."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from hfrt import CallTimeout, RemoteError
from tests.support import echo_specs, local_cluster

pytestmark = pytest.mark.timeout(60)


async def test_stream_calls_yield_partials_then_a_result_and_stop_when_closed() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        assert echo.endpoints["count"].get("stream") is True and "stream" not in echo.endpoints["ping"]

        stream = echo.count.stream(0, 5)
        assert [v async for v in stream] == [0, 1, 2, 3, 4] and await stream.result() == 5

        # values come as they are made: the first long before the last step
        stream = echo.count.stream(0, 6, 0.1)
        start = time.monotonic()
        first = await stream.__anext__()
        first_at = time.monotonic() - start
        # an ordered call sent now runs between two steps, not after the whole stream
        ping_start = time.monotonic()
        assert await echo.ping.call_one(0) == "pong"
        ping_s = time.monotonic() - ping_start
        rest = [v async for v in stream]
        total = time.monotonic() - start
        assert first == 0 and rest == [1, 2, 3, 4, 5] and first_at < total / 2, (first_at, total)
        assert ping_s < 0.5 * total, (ping_s, total)

        # closing early stops the generator on the daemon: no more steps, its finally ran
        stream = echo.count.stream(0, 1000, 0.01)
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        await asyncio.sleep(0.3)
        history = await echo.history.call_one(0)
        counted = [h for h in history if h[0] == "count"]
        assert got == [0, 1, 2] and ["count_closed", 1000] in history and len(counted) < 5 + 6 + 40, len(counted)
        assert ctl.stats()["pending_calls"] == 0

        # an error after two values: the values, then the error from the iteration and result()
        stream = echo.count.stream(0, 5, 0.0, 2)
        seen = []
        with pytest.raises(RemoteError, match="count failed at 2"):
            async for v in stream:
                seen.append(v)
        assert seen == [0, 1]
        with pytest.raises(RemoteError):
            await stream.result()

        with pytest.raises(TypeError, match="not a streaming endpoint"):
            echo.ping.stream(0)

        # timeout_s bounds each wait, not the whole stream: 1 s of steps 0.25 s apart within 0.6 s each
        stream = echo.count.stream(0, 4, 0.25, timeout_s=0.6)
        assert [v async for v in stream] == [0, 1, 2, 3]
        stream = echo.count.stream(0, 3, 0.8, timeout_s=0.4)
        with pytest.raises(CallTimeout):
            await stream.result()


def test_a_streaming_endpoint_must_be_a_plain_generator_and_says_so_in_its_table_entry() -> None:
    from hfrt.wire.endpoints import endpoint, endpoint_table

    class Streams:
        @endpoint(stream=True)
        def tokens(self, n: int) -> Iterator[int]:
            yield from range(n)

    assert endpoint_table(Streams)["tokens"][0].describe() == {
        "dispatch": "replicate", "concurrent": False, "stream": True, "params": [["n", "positional_or_keyword", False]],
    }
    async def agen(self: object) -> AsyncIterator[int]:
        yield 1

    for bad in (lambda self: [1], agen):  # a function returning a list; an async generator
        with pytest.raises(TypeError, match="stream=True needs a plain generator function"):
            endpoint(stream=True)(bad)
    with pytest.raises(TypeError, match="not concurrent"):
        endpoint(stream=True, concurrent=True)(Streams.tokens)
