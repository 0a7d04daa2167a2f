"""The `ping` flow: proves the runtime end to end on real daemons, with no model.

It checks hello/endpoint tables, round trips, split dispatch, overlap of calls to two ranks and
remote errors, and returns a summary. It knows the echo role's endpoints and nothing of RL.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from hfrt.wire.errors import RemoteError

ROLES: dict[str, dict[str, Any]] = {"echo": {"impl": "echo", "world_size": 2}}
#: every call here is tiny; a reply that never comes is a bug to report, not to wait for
TIMEOUT_S = 30.0


async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    echo = await ctl.role("echo")
    rounds = int(config.get("rounds", 200))
    rtts = []
    for _ in range(rounds):
        start = time.perf_counter()
        await echo.ping.call_one(0, timeout_s=TIMEOUT_S)
        rtts.append(time.perf_counter() - start)

    rows = await echo.tag_rows(list(range(8)), timeout_s=TIMEOUT_S)  # split across ranks, concatenated in order

    start = time.perf_counter()
    await asyncio.gather(*(echo.sleep.call_one(r, 0.2, timeout_s=TIMEOUT_S) for r in range(echo.world_size)))
    overlap_s = time.perf_counter() - start

    try:
        await echo.fail.call_one(0, "expected", timeout_s=TIMEOUT_S)
        error = "no error raised"
    except RemoteError as exc:
        error = f"{exc.where}: {exc.type_name}"

    return {
        "daemons": [d["role"] + f"[{d['rank']}] pid {d['pid']}" for d in await echo.describe.call(timeout_s=TIMEOUT_S)],
        "ping_p50_us": round(statistics.median(rtts) * 1e6, 1),
        "split_rows": rows,
        "overlap_two_0.2s_sleeps_s": round(overlap_s, 3),
        "remote_error": error,
        "stats": ctl.stats(),
    }
