"""Orphans: when a run's controller is killed (kill -9), its daemons exit within two heartbeat
intervals, at any scale — lone daemon processes and a daemon host of many daemons alike, at the
default 2 s heartbeat (docs/bench-and-performance.md, Scale, cites this test)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hfrt.protocols import new_key
from hfrt.protocols.signing import ENV_KEY
from tests.support import STARTED_PIDS, hfrt_cmd

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_S = 2.0
HOSTED = 64
LONE = 2

#: a controller that waits for `n` daemons, says "ready", then only serves (echoes heartbeats)
CONTROLLER = """
import asyncio, sys
from hfrt.control.controller import Controller
from hfrt.log import configure
from hfrt.protocols import load_key
from hfrt.wire.loop import run

async def main() -> None:
    async with Controller("tcp://127.0.0.1:0", load_key(), heartbeat_s=float(sys.argv[1])) as ctl:
        print(ctl.address, flush=True)
        while sum(d.alive for d in ctl.daemons()) < int(sys.argv[2]):
            await ctl.wait_change(1.0)
        print("ready", flush=True)
        await asyncio.Event().wait()

configure("warning")
run(main())
"""


def wait_exits(procs: list[subprocess.Popen[bytes]], since: float, limit_s: float) -> list[float]:
    """Seconds from `since` until each process exited (inf for one still running after limit_s)."""
    exited: dict[int, float] = {}
    while len(exited) < len(procs) and time.monotonic() - since < limit_s:
        for p in procs:
            if p.pid not in exited and p.poll() is not None:
                exited[p.pid] = time.monotonic() - since
        time.sleep(0.01)
    return [exited.get(p.pid, float("inf")) for p in procs]


@pytest.mark.slow
def test_a_killed_controllers_daemons_exit_within_two_heartbeats_lone_and_hosted() -> None:
    env = dict(os.environ, **{ENV_KEY: new_key().hex()})
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(HEARTBEAT_S), str(HOSTED + LONE)],
                                  env=env, stdout=subprocess.PIPE)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        assert controller.stdout is not None
        address = controller.stdout.readline().decode().strip()
        assert address.startswith("tcp://"), address
        common = ["--controller", address, "--heartbeat", str(HEARTBEAT_S), "--exit-with-controller", "--log-level", "warning"]
        daemons.append(subprocess.Popen(hfrt_cmd("daemon-host", "--role", "rank", "--count", str(HOSTED), *common), env=env))
        for rank in range(LONE):
            daemons.append(subprocess.Popen(hfrt_cmd("daemon", "--role", "cost", "--rank", str(rank), "--world-size", str(LONE),
                                                     "--impl", "hfrt.roles.diagnostic.scale:SimReward", *common), env=env))
        STARTED_PIDS.update(p.pid for p in daemons)
        assert controller.stdout.readline().decode().strip() == "ready"
        time.sleep(HEARTBEAT_S)  # beats and echoes flowing: the daemons were welcomed
        controller.kill()
        killed = time.monotonic()
        controller.wait()
        took = wait_exits(daemons, killed, 10 * HEARTBEAT_S)
    finally:
        controller.kill()
        for p in daemons:
            if p.poll() is None:
                p.kill()
            p.wait()
    print(f"after kill -9 of the controller (heartbeat {HEARTBEAT_S}s): host of {HOSTED} exited in {took[0]:.2f}s, "
          f"lone daemons in {', '.join(f'{t:.2f}s' for t in took[1:])}")
    assert all(t <= 2 * HEARTBEAT_S for t in took), f"{took}: not all within two heartbeats ({2 * HEARTBEAT_S}s)"
    assert [p.returncode for p in daemons] == [3] * len(daemons), "each exits as orphaned (code 3)"
