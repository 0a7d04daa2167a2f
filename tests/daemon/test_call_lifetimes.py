"""The daemon server's record of running calls, without processes: a call cancelled before its
first step leaves no entry behind, and winding down waits for threaded calls before teardown
(real threads, a stand-in for the socket), naming any it gave up on past the grace period."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Generator
from typing import Any

import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.server import DaemonServer, ServeConfig
from hfrt.protocols import Call, Reply, Wire, new_key
from hfrt.wire.endpoints import endpoint

pytestmark = pytest.mark.timeout(30)


class SlowDaemon(Daemon):
    """Endpoints of every kind that take a while; teardown records whether the threaded one ended."""

    def __init__(self, context: DaemonContext) -> None:
        super().__init__(context)
        self.threaded_finished = threading.Event()
        self.finished_before_teardown: bool | None = None

    @endpoint(concurrent=True)
    async def wait_async(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "waited"

    @endpoint(concurrent=True)
    def wait_threaded(self, seconds: float) -> str:
        time.sleep(seconds)
        self.threaded_finished.set()
        return "slept"

    @endpoint
    async def wait_ordered(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "waited in order"

    @endpoint(stream=True)
    def count(self, n: int) -> Generator[int, None, int]:
        yield from range(n)
        return n

    async def teardown(self) -> None:
        self.finished_before_teardown = self.threaded_finished.is_set()


class FakeChannel:
    """Stands in for the daemon's socket: keeps what is sent, never has input waiting."""

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []

    def send(self, frames: list[Any]) -> None:
        self.sent.append(frames)

    def has_input(self) -> bool:
        return False


Serving = tuple[DaemonServer, SlowDaemon, Wire]


@pytest_asyncio.fixture
async def serving() -> AsyncIterator[Serving]:
    """A server for SlowDaemon whose incoming messages the test hands over itself. Its tensor
    plane is started (a reply goes through it once torch is imported) and closed afterwards."""
    key = new_key()
    context = DaemonContext("slow")
    server = DaemonServer(SlowDaemon, context, ServeConfig("tcp://127.0.0.1:9"), key)
    server._loop = asyncio.get_running_loop()
    server._stopped = server._loop.create_future()
    daemon = SlowDaemon(context)
    server.daemon = daemon
    server._channel = FakeChannel()  # type: ignore[assignment]
    server.tensors.start("tcp://127.0.0.1:9")
    try:
        yield server, daemon, Wire(key)
    finally:
        server.tensors.close()


def replies(server: DaemonServer, wire: Wire) -> list[Any]:
    assert server._channel is not None
    return [m for m in (wire.unpack(f) for f in server._channel.sent) if isinstance(m, Reply)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("endpoint_name", ["wait_async", "wait_ordered", "count", "wait_threaded"])
async def test_a_call_cancelled_before_its_first_step_leaves_no_running_entry(endpoint_name: str, serving: Serving) -> None:
    server, _, wire = serving
    args = [3] if endpoint_name == "count" else [0.2]
    server._on_call(Call(7, endpoint_name, args, {}, True))
    if endpoint_name == "wait_ordered":  # an ordered call starts from the pump, one loop turn later
        await asyncio.sleep(0)
    assert 7 in server._calls.tasks, "the call should be running (scheduled) before it is cancelled"
    server._on_cancel(7)  # before the task took its first step
    for _ in range(5):
        await asyncio.sleep(0)
    assert 7 not in server._calls.tasks, f"{endpoint_name}: a call cancelled before it started is still recorded as running"
    assert not server.tensors.remembers(7) and 7 not in server._calls.skip_reply
    assert replies(server, wire) == []  # a cancelled call answers nothing


async def test_a_cancelled_call_that_started_leaves_no_entry_either(serving: Serving) -> None:
    server, _, _ = serving
    server._on_call(Call(8, "wait_async", [5.0], {}, True))
    await asyncio.sleep(0.05)  # inside its sleep
    server._on_cancel(8)
    await asyncio.sleep(0.05)
    assert 8 not in server._calls.tasks


async def test_wind_down_waits_for_a_threaded_call_before_teardown(serving: Serving) -> None:
    server, daemon, wire = serving
    server._on_call(Call(9, "wait_threaded", [0.4], {}, True))
    await asyncio.sleep(0.05)  # the endpoint is now inside its thread
    assert not daemon.threaded_finished.is_set()
    server.stop("test", grace_s=5.0)
    server._grace_s = 5.0
    start = time.monotonic()
    await server._wind_down()
    assert daemon.finished_before_teardown is True, "teardown ran while a threaded endpoint was still running"
    assert time.monotonic() - start < 4.0  # the call's 0.4 s, not the 5 s grace (slack for a loaded machine)
    assert [r.value for r in replies(server, wire)] == ["slept"]  # its reply went out before the bye


async def test_wind_down_names_the_threaded_call_it_gave_up_on_past_the_grace_period(serving: Serving) -> None:
    server, daemon, _ = serving
    server._on_call(Call(10, "wait_threaded", [1.0], {}, True))
    await asyncio.sleep(0.05)
    server._grace_s = 0.1
    start = time.monotonic()
    with capture_logs() as logs:
        await server._wind_down()
    took = time.monotonic() - start
    assert took < 1.5, f"wind-down waited {took:.2f}s past a 0.1s grace period"
    gave_up = [e for e in logs if e["event"] == "shutdown_gave_up"]
    assert gave_up and gave_up[0]["log_level"] == "error", logs
    assert "wait_threaded" in str(gave_up[0]["calls"]) and "10" in str(gave_up[0]["calls"])
    assert daemon.finished_before_teardown is False
    daemon.threaded_finished.wait(2.0)  # let the thread end before the test's loop closes
