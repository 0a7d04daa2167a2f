"""Shutting a real daemon process down while a concurrent synchronous endpoint runs in its thread
pool: the daemon waits for the endpoint (within the shutdown's grace period) before it runs its
teardown, and its reply still reaches the caller before the daemon says bye."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from hfrt.deploy.launchers.base import expand
from tests.support import local_cluster

pytestmark = pytest.mark.timeout(90)

IMPL = f"{Path(__file__).with_name('sleepy_daemon.py')}:SleepyDaemon"


async def test_teardown_runs_after_a_threaded_endpoint_finishes(tmp_path: Path) -> None:
    record = tmp_path / "teardown.json"
    async with local_cluster(expand("sleepy", 1, IMPL, options={"record": str(record)})) as (ctl, _):
        sleepy = await ctl.role("sleepy")
        call = asyncio.ensure_future(sleepy.sleep(1.5))
        deadline = time.monotonic() + 10
        while not (await sleepy.ready())[0]:
            assert time.monotonic() < deadline, "the threaded endpoint never started"
            await asyncio.sleep(0.05)
        asked = time.monotonic()
        await ctl.shutdown_daemons("test: shut down mid-call", grace_s=10.0, wait_s=20.0)
        waited = time.monotonic() - asked
        assert await asyncio.wait_for(call, 5.0) == ["slept"]  # answered before the bye
    written = json.loads(record.read_text())
    print(f"shutdown asked mid-call; daemon said bye {waited:.2f}s later; teardown saw {written}")
    assert written["started"] and written["finished"], f"teardown ran while the endpoint was still in its thread: {written}"
    assert waited < 8.0
