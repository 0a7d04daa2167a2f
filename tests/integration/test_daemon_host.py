"""`hfrt daemon-host`: N daemons in one real process speak the real protocol to a real controller —
each its own identity, hello, endpoint table, heartbeat and directory entry — and leave as lone
daemons do (a Shutdown, SIGTERM, a killed host noticed by heartbeats alone)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from hfrt.control.controller import Controller
from hfrt.protocols import BatchHandle, Shard, TensorHandle, new_key
from hfrt.protocols.signing import ENV_KEY
from tests.support import STARTED_PIDS, hfrt_cmd, wait_for

pytestmark = pytest.mark.timeout(90)


@asynccontextmanager
async def host(n: int, role: str = "rank", *extra: str, heartbeat_s: float = 1.0) -> AsyncIterator[tuple[Controller, subprocess.Popen[bytes]]]:
    """A controller, and one `hfrt daemon-host` process serving n daemons of `role` to it."""
    key = new_key()
    async with Controller("tcp://127.0.0.1:0", key, heartbeat_s=heartbeat_s) as ctl:
        proc = subprocess.Popen(
            hfrt_cmd("daemon-host", "--controller", ctl.address, "--role", role, "--count", str(n),
                     "--heartbeat", str(heartbeat_s), "--exit-with-controller", *extra),
            env=dict(os.environ, **{ENV_KEY: key.hex()}))
        STARTED_PIDS.add(proc.pid)
        try:
            yield ctl, proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


async def test_a_hosts_daemons_are_each_a_daemon_to_the_controller() -> None:
    async with host(8) as (ctl, proc):
        group = await ctl.role("rank", timeout_s=60)
        infos = ctl.daemons("rank")
        assert [d.identity for d in infos] == [f"rank:{r}" for r in range(8)]
        assert {d.pid for d in infos} == {proc.pid}  # one process
        assert all({"ping", "take", "describe"} <= set(d.endpoints) for d in infos)
        assert len({d.meta["data"] for d in infos}) == 1 and infos[0].meta["data"].startswith("tcp://")
        assert await group.ping.call() == ["pong"] * 8
        shards = tuple(Shard(d.identity, 3, {"x": TensorHandle(d.identity, f"k{d.rank}", (3, 2), "float32", "cpu", 24)})
                       for d in infos)
        assert await group.take(BatchHandle(shards)) == [3] * 8  # one shard per rank, split by dp rank
        # every daemon beats on its own: all are seen within one interval, again and again
        seen = {d.identity: d.last_seen for d in infos}
        await asyncio.sleep(2.5 * ctl.heartbeat_s)
        assert all(d.alive and d.last_seen > seen[d.identity] for d in ctl.daemons("rank"))
        await ctl.shutdown_daemons(wait_s=10)
        assert not any(d.alive for d in ctl.daemons("rank"))
        assert proc.wait(10) == 0


async def test_sigterm_stops_every_daemon_of_the_host_with_a_bye() -> None:
    async with host(4) as (ctl, proc):
        await ctl.role("rank", timeout_s=60)
        proc.send_signal(signal.SIGTERM)
        assert await wait_for(lambda: not any(d.alive for d in ctl.daemons("rank")), 10)
        assert all("signal SIGTERM" in d.gone_reason and "code 0" in d.gone_reason for d in ctl.daemons("rank"))
        assert proc.wait(10) == 0


@pytest.mark.slow
async def test_a_killed_hosts_daemons_are_declared_gone_by_their_silence() -> None:
    async with host(16, heartbeat_s=0.5) as (ctl, proc):
        await ctl.role("rank", timeout_s=60)
        killed = time.monotonic()
        proc.kill()
        assert await wait_for(lambda: not any(d.alive for d in ctl.daemons("rank")), 5)
        took = time.monotonic() - killed
        print(f"16 hosted daemons declared gone {took:.2f}s after kill -9 (heartbeat 0.5s)")
        assert took <= 2 * ctl.heartbeat_s + 0.5
        assert all("no heartbeat" in d.gone_reason for d in ctl.daemons("rank"))


async def test_the_ppo_roles_simulated_endpoints_sleep_their_stated_time() -> None:
    async with host(2, "reward", "--compute-s", "0.3") as (ctl, _):
        reward = await ctl.role("reward", timeout_s=60)
        batch = BatchHandle.inline({"prompt": ["a", "b", "c", "d"]})
        start = time.monotonic()
        scores = await reward.score(batch)
        assert time.monotonic() - start >= 0.3
        assert len(scores) == 4 and [s.owner for s in scores.shards] == ["reward:0", "reward:1"]
        assert [v for s in scores.shards for v in s.non_tensor["score"]] == [1.0] * 4


def test_bad_host_arguments_are_refused_naming_them() -> None:
    env = dict(os.environ, **{ENV_KEY: new_key().hex()})
    out = subprocess.run(hfrt_cmd("daemon-host", "--controller", "tcp://127.0.0.1:1", "--role", "rank", "--count", "4",
                                  "--world-size", "2"), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "ranks 0..3 do not fit --world-size 2" in out.stderr
    out = subprocess.run(hfrt_cmd("daemon-host", "--controller", "tcp://127.0.0.1:1", "--role", "reward", "--count", "1",
                                  "--options", '{"compute_s": {"score": -1}}'), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "compute_s['score'] = -1 is not a number of seconds >= 0" in out.stderr

