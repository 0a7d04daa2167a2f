"""The daemon host's one heartbeat thread (hfrt.daemon.beat_hub) against a ROUTER socket standing in
for the controller: every daemon beats under its own identity, echoes batched by the controller's
channel are each read, and a heartbeat socket still connecting is no sign of a dead controller."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from hfrt.daemon.beat_hub import BeatHub
from hfrt.daemon.heartbeat import HeartbeatEvent
from hfrt.daemon.server import ServeConfig
from hfrt.protocols import Heartbeat, Wire, new_key
from hfrt.wire.channel import BATCH_MARK, unbatch

pytestmark = pytest.mark.timeout(30)
INTERVAL = 0.1


class Heard:
    def __init__(self) -> None:
        self.events: list[tuple[str, HeartbeatEvent, str]] = []

    def of(self, identity: str) -> Any:
        return lambda event, detail: self.events.append((identity, event, detail))


def test_unbatch_splits_a_channels_batch_and_keeps_any_other_message_whole() -> None:
    assert unbatch([BATCH_MARK, b"m1", b"m2"]) == [[b"m1"], [b"m2"]]
    assert unbatch([b"body", b"buffer"]) == [[b"body", b"buffer"]]


def test_every_daemon_beats_as_itself_and_batched_echoes_are_each_read() -> None:
    key = new_key()
    wire = Wire(key)
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    hub = BeatHub(ctx, address, key)
    heard = Heard()
    config = ServeConfig(address, heartbeat_s=INTERVAL, exit_with_controller=True)
    members = [hub.beats(f"r:{i}", config, heard.of(f"r:{i}")) for i in range(3)]
    hub.start()
    try:
        for m in members:
            m.start()
            m.welcome("s1", INTERVAL)
        seen: set[bytes] = set()
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            if router.poll(100):
                ident, *frames = router.recv_multipart()
                assert isinstance(wire.unpack(frames), Heartbeat)
                seen.add(ident)
        assert seen == {b"r:0/hb", b"r:1/hb", b"r:2/hb"}
        echo = [wire.pack(Heartbeat(s, 0, 0.0))[0] for s in ("s1", "s2")]
        router.send_multipart([b"r:1/hb", BATCH_MARK, *echo])  # two echoes the controller queued in one turn
        deadline = time.monotonic() + 5
        while not heard.events and time.monotonic() < deadline:
            time.sleep(0.02)
        assert heard.events == [("r:1", HeartbeatEvent.REHELLO, "s2")], "the batch's second echo named a new session"
    finally:
        hub.stop()
        hub.join(5)
        router.close(0)
        ctx.term()


def test_a_heartbeat_socket_that_never_connected_does_not_orphan_a_welcomed_daemon() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    with zmq.Context().socket(zmq.ROUTER) as probe:  # a port nothing listens on once closed
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    hub = BeatHub(ctx, address, new_key())
    heard = Heard()
    member = hub.beats("r:0", ServeConfig(address, heartbeat_s=INTERVAL, orphan_timeout_s=0, exit_with_controller=True),
                       heard.of("r:0"))
    hub.start()
    try:
        member.start()
        member.welcome("s1", INTERVAL)
        time.sleep(10 * INTERVAL)  # silent for five times what a closed connection would allow
        assert heard.events == [], "still connecting is not a closed connection"
        assert member.connected
    finally:
        hub.stop()
        hub.join(5)
        ctx.term()
