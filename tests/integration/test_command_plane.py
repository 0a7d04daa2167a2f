"""Hostile peers and liveness on the command plane, with real daemon processes and sockets:
forged replies from key holders, heartbeat intervals out of range, frozen and starved daemons."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from hfrt import DaemonGone
from hfrt.deploy.base import DaemonSpec
from hfrt.protocols import PROTOCOL_VERSION, Error, Hello, Reply, Wire
from tests.support import echo_specs, local_cluster, wait_for

pytestmark = pytest.mark.timeout(90)


class Rogue:
    """A DEALER that holds the cluster key, optionally under a routing id of its choosing."""

    def __init__(self, ctx: zmq.Context[Any], address: str, wire: Wire, identity: bytes | None = None) -> None:
        self.wire = wire
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(address)

    def forge(self, call_ids: list[int]) -> None:
        for call_id in call_ids:
            self.sock.send_multipart(self.wire.pack(Reply(call_id, "forged", 0.0)))
            self.sock.send_multipart(self.wire.pack(Error(call_id, "Forged", "forged error", "")))


async def test_replies_from_any_peer_but_the_callee_are_dropped() -> None:
    async with local_cluster(echo_specs(1), heartbeat_s=0.5) as (ctl, _):
        echo = await ctl.role("echo")
        assert await echo.ping.call_one(0) == "pong"
        pending = [echo.sleep.call_one(0, 1.5, tag=i) for i in range(3)]
        await asyncio.sleep(0.1)
        call_ids = sorted(ctl._calls)
        assert len(call_ids) == 3
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            stranger = Rogue(ctx, ctl.address, ctl._wire)  # never said hello
            impostor = Rogue(ctx, ctl.address, ctl._wire, b"rogue:0")  # said hello as another daemon
            impostor.sock.send_multipart(ctl._wire.pack(Hello(PROTOCOL_VERSION, "rogue", 0, 1, 0, 1, 1, "h", "x", {}, {})))
            await ctl.role("rogue", timeout_s=10)
            stranger.forge(call_ids)
            impostor.forge(call_ids)
            assert await wait_for(lambda: ctl.stats()["dropped_replies"] >= 4 * len(call_ids), 10)
            assert not any(p.done() for p in pending), "a forged reply settled a call"
            assert await asyncio.wait_for(asyncio.gather(*pending), 20) == [1.5, 1.5, 1.5]
            assert ctl.stats()["pending_calls"] == 0
        finally:
            ctx.destroy(linger=0)
