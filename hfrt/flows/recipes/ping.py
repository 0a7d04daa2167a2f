"""The `ping` flow: proves the runtime end to end on real daemons, with no model.

It checks hello/endpoint tables, round trips, split dispatch, overlap of calls to two ranks and
remote errors, and returns a summary. One call fails on purpose (`echo.fail`, to show a remote error
coming back typed), so the controller's `stats.errors` reads 1 on a healthy run; the summary says
so (`errors_intended`) and counts any other (`errors_unintended`, 0 on a healthy run). It knows the
echo role's endpoints and nothing of RL.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from hfrt.control.typed_roles import typed
from hfrt.wire.errors import RemoteError
from hfrt.wire.role_views import Echo

ROLES: dict[str, dict[str, Any]] = {"echo": {"impl": "echo", "world_size": 2}}
#: every call here is tiny; a reply that never comes is a bug to report, not to wait for (the
#: echo endpoints are used with this deadline instead of the controller's default)
TIMEOUT_S = 30.0
#: what the summary says of stats.errors: the one echo.fail call made on purpose
INTENDED = "1: echo.fail raises on purpose, to show that a remote error comes back typed (remote_error)"


async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    echo = typed(await ctl.role("echo"), Echo)
    rounds = int(config.get("rounds", 200))
    rtts = []
    ping = echo.ping.with_timeout(TIMEOUT_S)
    for _ in range(rounds):
        start = time.perf_counter()
        await ping.call_one(0)
        rtts.append(time.perf_counter() - start)

    rows = await echo.tag_rows.with_timeout(TIMEOUT_S)(list(range(8)))  # split across ranks, concatenated in order

    start = time.perf_counter()
    await asyncio.gather(*(echo.sleep.with_timeout(TIMEOUT_S).call_one(r, 0.2) for r in range(echo.world_size)))
    overlap_s = time.perf_counter() - start

    intended = 1  # echo.fail's reply, counted in stats.errors
    try:
        await echo.fail.with_timeout(TIMEOUT_S).call_one(0, "expected")
        error, intended = "no error raised", 0
    except RemoteError as exc:
        error = f"{exc.where}: {exc.type_name}"

    daemons = [d["role"] + f"[{d['rank']}] pid {d['pid']}" for d in await echo.describe.with_timeout(TIMEOUT_S).call()]
    stats = ctl.stats()
    return {
        "daemons": daemons,
        "ping_p50_us": round(statistics.median(rtts) * 1e6, 1),
        "split_rows": rows,
        "overlap_two_0.2s_sleeps_s": round(overlap_s, 3),
        "remote_error": error,
        "errors_intended": INTENDED if intended else "0: echo.fail did not raise (a bug: see remote_error)",
        "errors_unintended": stats["errors"] - intended,
        "stats": stats,
    }
