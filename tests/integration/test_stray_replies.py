"""Signed replies and errors for call ids that are not pending (a hostile or confused peer that
holds the key) are counted in the controller's stats and logged once per peer; a reply to a call
the controller gave up on (cancelled, timed out) is counted as late, without a warning. Over a
real socket."""

from __future__ import annotations

import pytest
import structlog
import zmq

from hfrt.control.controller import Controller
from hfrt.protocols import Error, Reply, Wire, new_key
from tests.support import wait_for

pytestmark = pytest.mark.timeout(30)


async def test_replies_for_calls_that_are_not_pending_are_counted_and_logged_once_per_peer() -> None:
    key = new_key()
    async with Controller("tcp://127.0.0.1:0", key, heartbeat_s=1.0) as ctl:
        ctx = zmq.Context()
        peers = []
        try:
            for name in (b"stranger:0", b"stranger:1"):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.ROUTING_ID, name)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(ctl.address)
                peers.append(sock)
            wire = Wire(key)
            with structlog.testing.capture_logs() as logs:
                ctl._strays.given_up(55)  # as a cancelled call is; its reply arrives after all
                peers[0].send_multipart(wire.pack(Reply(55, "late", 0.0)))
                assert await wait_for(lambda: ctl.stats()["late_replies"] == 1, 5), ctl.stats()
                assert not [e for e in logs if e["event"] == "unmatched_reply"]
                for call_id in range(100, 110):
                    peers[0].send_multipart(wire.pack(Reply(call_id, "forged", 0.0)))
                peers[1].send_multipart(wire.pack(Reply(7, "late", 0.0)))
                peers[1].send_multipart(wire.pack(Error(8, "RuntimeError", "late error", "")))
                assert await wait_for(lambda: ctl.stats()["unmatched_replies"] == 12, 5), ctl.stats()
        finally:
            for sock in peers:
                sock.close(0)
            ctx.term()
    unmatched = [e for e in logs if e["event"] == "unmatched_reply"]
    assert sorted(e["peer"] for e in unmatched) == ["stranger:0", "stranger:1"]
    assert unmatched[0]["log_level"] == "warning"
