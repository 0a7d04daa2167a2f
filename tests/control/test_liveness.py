"""The controller's liveness decisions and what a failure of its own machinery does, without
daemon processes: a stand-in daemon is one DEALER socket that says hello and then stays silent.

A silent daemon is declared gone and its pending call fails naming it; a gone-listener that
raises, or a liveness watcher that crashes, fails the session loudly: pending calls fail with
the error, new calls and role lookups raise it, and close() re-raises it (never swallowed)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import zmq
from structlog.testing import capture_logs

from hfrt.control.controller import Controller
from hfrt.control.daemons import DaemonInfo
from hfrt.control.liveness import DEAD_AFTER, next_deadline, silent
from hfrt.protocols import PROTOCOL_VERSION, Hello, Wire, new_key
from hfrt.wire.errors import ControllerFailed, DaemonGone

pytestmark = pytest.mark.timeout(30)

HEARTBEAT_S = 0.1


class StandIn:
    """A daemon that is only a socket: it says hello as echo:0 and never beats or replies."""

    def __init__(self, address: str, key: bytes) -> None:
        self.zmq: zmq.Context[Any] = zmq.Context()
        self.sock = self.zmq.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, b"echo:0")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        hello = Hello(PROTOCOL_VERSION, "echo", 0, 1, 0, 1, os.getpid(), "stand-in", "echo", {}, {"host": "elsewhere"})
        self.sock.send_multipart(Wire(key).pack(hello))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.zmq.term()


@pytest_asyncio.fixture
async def controller() -> AsyncIterator[tuple[Controller, list[Exception]]]:
    """A started controller with a stand-in daemon; an exception put in the list it yields is
    raised by the liveness watcher's next read of the socket."""
    key = new_key()
    ctl = Controller("tcp://127.0.0.1:0", key, heartbeat_s=HEARTBEAT_S)
    trip: list[Exception] = []
    read_waiting = ctl._read_waiting

    def tripwire() -> None:
        if trip:
            raise trip[0]
        read_waiting()

    ctl._read_waiting = tripwire  # type: ignore[method-assign]  # what the watcher is given at start
    await ctl.start()
    daemon = StandIn(ctl.address, key)
    try:
        yield ctl, trip
    finally:
        daemon.close()
        try:
            await ctl.close()
        except ControllerFailed:
            pass  # the tests that fail the session assert this themselves


async def said_hello(ctl: Controller) -> DaemonInfo:
    for _ in range(100):
        info = ctl.daemon("echo:0")
        if info is not None:
            return info
        await ctl.wait_change(0.05)
    raise AssertionError("the stand-in daemon's hello never arrived")


def test_a_daemon_is_silent_only_past_its_deadline() -> None:
    info = DaemonInfo("echo:0", "echo", 0, 1, 0, 1, 1, "h", "echo", {}, last_seen=10.0)
    assert next_deadline([info], 2.0) == 10.0 + DEAD_AFTER * 2.0
    assert silent([info], 10.0 + DEAD_AFTER * 2.0 - 0.01, 2.0) == []
    assert [i for i, _ in silent([info], 10.0 + DEAD_AFTER * 2.0 + 0.01, 2.0)] == ["echo:0"]
    info.alive = False
    assert silent([info], 100.0, 2.0) == [] and next_deadline([info], 2.0) == float("inf")


async def test_a_silent_daemon_is_declared_gone_and_its_pending_call_fails_naming_it(controller: Any) -> None:
    ctl, _ = controller
    info = await said_hello(ctl)
    heard: list[str] = []
    ctl.gone_listeners.append(lambda d, reason, expected: heard.append(d.identity))
    call = ctl.submit(info, "echo", [1], {})
    with pytest.raises(DaemonGone, match=r"echo\[0\].*no heartbeat"):
        await asyncio.wait_for(call, 2 * HEARTBEAT_S + 1.0)
    assert heard == ["echo:0"] and not info.alive


async def test_a_gone_listener_that_raises_fails_the_session_loudly(controller: Any) -> None:
    ctl, _ = controller
    info = await said_hello(ctl)

    def broken(daemon: DaemonInfo, reason: str, expected: bool) -> None:
        raise KeyError("listener bug")

    ctl.gone_listeners.append(broken)
    call = ctl.submit(info, "echo", [1], {})
    with capture_logs() as logs:
        with pytest.raises(ControllerFailed, match="gone-listener.*KeyError.*listener bug") as failed:
            await asyncio.wait_for(call, 2 * HEARTBEAT_S + 1.0)  # the flow's await raises it
    assert isinstance(failed.value.__cause__, KeyError)
    assert any(e["event"] == "controller_failed" and e["log_level"] == "error" for e in logs), logs
    assert watching(ctl), "the liveness watcher should still run for the other daemons"
    assert_session_failed(ctl, info)
    with pytest.raises(ControllerFailed, match="listener bug"):
        await ctl.close()  # re-raised, not swallowed


async def test_a_crashed_liveness_watcher_fails_the_session_and_its_pending_calls(controller: Any) -> None:
    ctl, trip = controller
    info = await said_hello(ctl)
    call = ctl.submit(info, "echo", [1], {})
    trip.append(RuntimeError("socket read failed"))  # the watcher's next wake-up raises inside it
    with pytest.raises(ControllerFailed, match="liveness watcher.*RuntimeError.*socket read failed"):
        await asyncio.wait_for(call, 2 * HEARTBEAT_S + 1.0)
    assert not watching(ctl)
    assert_session_failed(ctl, info)
    with pytest.raises(ControllerFailed, match="socket read failed"):
        await ctl.close()


def watching(ctl: Controller) -> bool:
    return ctl._watcher is not None and not ctl._watcher.done()


def assert_session_failed(ctl: Controller, info: DaemonInfo) -> None:
    """After a failure every new call fails at once with it, and waiting for a role raises it."""
    later = ctl.submit(info, "echo", [2], {})
    assert later.done() and isinstance(later.exception(), ControllerFailed)
    assert ctl.stats()["pending_calls"] == 0


async def test_waiting_for_a_role_raises_the_failure(controller: Any) -> None:
    ctl, trip = controller
    await said_hello(ctl)
    waiting = asyncio.ensure_future(ctl.role("critic", timeout_s=10.0))
    await asyncio.sleep(0.05)
    trip.append(RuntimeError("boom"))
    with pytest.raises(ControllerFailed, match="boom"):
        await asyncio.wait_for(waiting, 2.0)
