"""Calls against real daemon processes over tcp and ipc: adverbs, overlap, ordering, errors, cancel."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from hfrt import BadArguments, CallTimeout, RemoteError, UnknownEndpoint
from hfrt.deploy.launchers.base import DaemonSpec, expand
from tests.support import echo_specs, local_cluster

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["tcp", "ipc"])
def address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/ctl.sock"


async def test_adverbs_and_dispatch_modes(address: str) -> None:
    async with local_cluster(echo_specs(3), address=address) as (ctl, _):
        echo = await ctl.role("echo")
        assert echo.world_size == 3
        assert await echo.ping() == ["pong"] * 3  # replicate: one result per rank
        assert await echo.ping.call() == ["pong"] * 3
        assert await echo.ping.call_one(2) == "pong"
        assert await echo.echo.call_one(1, {"nested": [1, b"\x00", None]}) == {"nested": [1, b"\x00", None]}
        assert await echo.leader() == 0  # rank zero only
        rows = await echo.tag_rows(list(range(7)))  # split by dp rank, concatenated in order
        assert rows == [[0, 0], [0, 1], [0, 2], [1, 3], [1, 4], [2, 5], [2, 6]]
        echo.record.broadcast("b")  # returns at once, no reply; the next calls arrive after it
        histories = await echo.history.call()
        assert all(["record", "b"] in h for h in histories)
        described = await echo.describe.call()
        assert [d["rank"] for d in described] == [0, 1, 2]
        assert ctl.stats()["controller_bulk_bytes"] == 0


async def test_calls_to_two_daemons_overlap(address: str) -> None:
    async with local_cluster(echo_specs(2), address=address) as (ctl, _):
        echo = await ctl.role("echo")
        await echo.ping()
        start = time.monotonic()
        a, b = await asyncio.gather(echo.block.call_one(0, 0.6), echo.block.call_one(1, 0.6))
        wall = time.monotonic() - start
        assert (a, b) == (0.6, 0.6)
        assert wall < 1.0, f"two 0.6 s calls on two daemons took {wall:.2f}s: they did not overlap"


async def test_calls_to_one_daemon_run_in_arrival_order() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        calls = [echo.sleep.call_one(0, 0.05 * (3 - i), i) if i % 2 else echo.block.call_one(0, 0.02, i) for i in range(6)]
        await asyncio.gather(*calls)
        history = await echo.history.call_one(0)
        assert history == [[kind, i] for i in range(6) for kind in ("start", "end")]


async def test_concurrent_endpoints_overlap_on_one_daemon() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        start = time.monotonic()
        await asyncio.gather(*(echo.sleep_concurrent.call_one(0, 0.5, i) for i in range(4)))
        wall = time.monotonic() - start
        assert wall < 1.2, f"four concurrent 0.5 s sleeps took {wall:.2f}s"
        history = await echo.history.call_one(0)
        assert [k for k, _ in history[:4]] == ["start"] * 4  # all started before any ended


async def test_remote_error_carries_type_message_and_traceback() -> None:
    async with local_cluster(echo_specs(2)) as (ctl, _):
        echo = await ctl.role("echo")
        with pytest.raises(RemoteError) as info:
            await echo.fail.call_one(1, "boom")
        err = info.value
        assert err.where == "echo[1].fail" and err.type_name == "ValueError" and err.message == "boom"
        assert 'raise ValueError(message)' in err.remote_traceback
        assert "echo[1].fail raised ValueError: boom" in str(err)
        assert await echo.ping.call_one(1) == "pong"  # the daemon keeps serving


PICKY = '''
from hfrt import Daemon, endpoint
from hfrt.wire.errors import InvalidArgument
class Picky(Daemon):
    @endpoint
    def resize(self, size: int, mode: str = "fit") -> int:
        if size < 1:
            raise InvalidArgument("size", f"size: must be at least 1, got {size}")
        if mode not in ("fit", "fill"):
            raise InvalidArgument("mode", f"mode: {mode!r} is not fit or fill")
        return size
'''


async def test_a_refused_argument_is_named_by_the_error(tmp_path: Path) -> None:
    """An endpoint raising InvalidArgument: the controller's RemoteError carries the argument's
    name as `param` (a field of the error record, not read from the message); other errors carry
    None (docs/roles-and-losses.md, protocols/README.md)."""
    module = tmp_path / "picky_role.py"
    module.write_text(PICKY)
    async with local_cluster([DaemonSpec("picky", 0, 1, impl=f"{module}:Picky")]) as (ctl, _):
        picky = await ctl.role("picky")
        for kwargs, param in (({"size": 0}, "size"), ({"size": 2, "mode": "stretch"}, "mode")):
            with pytest.raises(RemoteError) as info:
                await picky.resize.call_one(0, **kwargs)
            assert (info.value.type_name, info.value.param) == ("InvalidArgument", param), info.value
        with pytest.raises(RemoteError) as plain:
            await ctl.submit(ctl.daemons("picky")[0], "resize", ["two"], {})  # a TypeError in the endpoint
        assert plain.value.type_name == "TypeError" and plain.value.param is None
        assert await picky.resize.call_one(0, 3) == 3


async def test_bad_calls_get_clear_errors_and_the_daemon_keeps_serving() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        with pytest.raises(UnknownEndpoint, match="no endpoint 'nope'; it has: .*ping"):
            _ = echo.nope
        info = echo.daemons[0]
        with pytest.raises(RemoteError, match="UnknownEndpoint: role 'echo' has no endpoint 'nope'"):
            await ctl.submit(info, "nope", [], {})  # sent anyway: the daemon refuses it too
        with pytest.raises(BadArguments, match=r"echo\.echo\(value\) is missing required argument\(s\) 'value'"):
            await echo.echo.call_one(0)  # refused here, before sending (tests/integration/test_call_site_checks.py)
        with pytest.raises(RemoteError, match=r"BadArguments: echo\(value\).*missing a required argument"):
            await ctl.submit(info, "echo", [], {})  # sent anyway: the daemon refuses it too
        with pytest.raises(RemoteError, match="BadArguments: .*unexpected keyword"):
            await ctl.submit(info, "ping", [], {"bogus": 1})
        with pytest.raises(RemoteError, match="UnencodableResult"):
            await echo.unsendable.call_one(0)
        with pytest.raises(TypeError, match="cannot send arguments"):
            await echo.echo.call_one(0, object())
        assert await echo.ping.call_one(0) == "pong"


async def test_oversized_result_is_refused_not_dropped() -> None:
    specs = [s for s in expand("echo", 1, "echo")]
    async with local_cluster(specs) as (ctl, _):
        echo = await ctl.role("echo")
        with pytest.raises(RemoteError, match="ResultTooLarge: .*max_frame_bytes"):
            await echo.blob.call_one(0, 65 * 2**20)
        assert await echo.ping.call_one(0) == "pong"


async def test_cancelling_a_queued_call_means_it_never_runs() -> None:
    """Deterministic: the gate holds the queue until the test opens it, and the release is sent after
    the Cancel on the same connection, so the daemon has seen the Cancel before the queue moves."""
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        gate = echo.gate.call_one(0, "g")
        victim = echo.record.call_one(0, "victim")
        after = echo.record.call_one(0, "after")
        await asyncio.sleep(0.05)
        victim.cancel()
        await asyncio.sleep(0)  # let the Cancel leave before the release
        await echo.release.call_one(0, "g")
        assert await gate == "g" and await after == 2
        history = await echo.history.call_one(0)
        assert history == [["gate", "g"], ["record", "after"]]


async def test_cancelling_a_running_async_call_cancels_it_on_the_daemon() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        call = echo.sleep_concurrent.call_one(0, 5.0, "long")
        await asyncio.sleep(0.3)
        call.cancel()

        async def cancelled() -> bool:
            return ["cancelled", "long"] in await echo.history.call_one(0)

        deadline = time.monotonic() + 5
        while not await cancelled():
            assert time.monotonic() < deadline, "the daemon never cancelled the running call"
            await asyncio.sleep(0.05)


async def test_timeout_raises_and_tells_the_daemon() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        start = time.monotonic()
        with pytest.raises(CallTimeout, match=r"echo\[0\].sleep did not finish within 0.3s"):
            await echo.sleep.call_one(0, 10.0, "slow", timeout_s=0.3)
        assert time.monotonic() - start < 2.0
        # The ordered queue is free again only because the daemon cancelled the sleep.
        assert await echo.ping.call_one(0, timeout_s=5.0) == "pong"
        assert ["end", "slow"] not in await echo.history.call_one(0)


async def test_many_pipelined_calls_all_resolve_in_order() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        results = await asyncio.gather(*(echo.echo.call_one(0, i) for i in range(2000)))
        assert results == list(range(2000))
        assert ctl.stats()["pending_calls"] == 0
