"""Latency benchmark: hfrt call round trip, pipelined throughput and fan-out, against raw pyzmq
REQ/REP, a bare asyncio+ZeroMQ echo (the event-loop floor) and, when installed, a Ray actor call.

The three round-trip measurements are interleaved in blocks within one run, so a machine whose
load drifts (as shared 2-core machines do) moves all of them alike and the ratios stay fair.
Run: `hfrt bench latency [--json] [--out FILE]`. It starts its own daemons and reference servers
and knows nothing of RL.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import time
from collections import deque
from typing import Any

import zmq

from hfrt.bench.common import add_output_flags, emit, machine
from hfrt.bench.latency_report import report, targets_met
from hfrt.control.controller import Controller
from hfrt.deploy.launchers.base import expand
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.log import configure as configure_logging
from hfrt.protocols import Call, Wire, new_key
from hfrt.wire.loop import loop_factory, run

#: Sync REQ/REP echo: the physical reference.
RAW_SERVER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.REP); port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    s.send(s.recv())
"""

#: The same echo with the socket driven by an asyncio (uvloop) reader callback, as hfrt drives it.
FLOOR_SERVER = """
import asyncio, sys, zmq
async def main():
    ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.connect(sys.argv[1])
    loop = asyncio.get_running_loop()
    def drain():
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            s.send_multipart(s.recv_multipart(zmq.NOBLOCK), zmq.NOBLOCK)
    loop.add_reader(s.getsockopt(zmq.FD), drain)
    s.send(b"hi"); drain()
    await asyncio.Event().wait()
try:
    import uvloop; uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def payload() -> bytes:
    """A signed no-op Call as hfrt sends it, so the references move the same bytes."""
    return b"".join(Wire(new_key()).pack(Call(123456, "ping", [], {}, True)))


class RawReference:
    """Sync REQ client in this process against the sync REP server subprocess."""

    def __init__(self, ctx: zmq.Context[Any], message: bytes) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.sock = ctx.socket(zmq.REQ)
        self.sock.connect(f"tcp://127.0.0.1:{int(self.proc.stdout.readline())}")
        self.message = message

    def block(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            self.sock.send(self.message)
            self.sock.recv()
            out.append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.proc.kill()
        self.proc.wait()


class FloorReference:
    """asyncio reader-callback ROUTER in this process against the asyncio DEALER echo subprocess."""

    def __init__(self, ctx: zmq.Context[Any], message: bytes) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:0")
        address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.proc = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, address])
        self.peer = self.sock.recv_multipart()[0]
        self.message = message
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[None] | None = None
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)

    def _drain(self) -> None:
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.sock.recv_multipart(zmq.NOBLOCK)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    async def block(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            self.waiter = self.loop.create_future()
            self.sock.send_multipart([self.peer, self.message], zmq.NOBLOCK)
            if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.loop.call_soon(self._drain)
            await self.waiter
            out.append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        self.sock.close(0)
        self.proc.kill()
        self.proc.wait()


async def timed_calls(ping: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await ping()
        out.append(time.perf_counter() - t)
    return out


async def pipelined(ping: Any, inflight: int, duration_s: float) -> float:
    window: deque[asyncio.Future[Any]] = deque()
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        for _ in range(256):
            if len(window) >= inflight:
                await window.popleft()
                done += 1
            window.append(ping())
    while window:
        await window.popleft()
        done += 1
    return done / (time.perf_counter() - start)


async def measure(args: argparse.Namespace) -> dict[str, float]:
    key = new_key()
    message = payload()
    zctx: zmq.Context[Any] = zmq.Context()
    raw, floor = RawReference(zctx, message), FloorReference(zctx, message)
    async with Controller("tcp://127.0.0.1:0", key) as ctl:
        launcher = LocalLauncher(log_level="warning")
        await launcher.start(expand("echo", args.fanout, "echo"), controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        try:
            echo = await ctl.role("echo", timeout_s=60)
            def one() -> Any:
                return echo.ping.call_one(0)

            await timed_calls(one, 1000)
            raw.block(500)
            await floor.block(500)
            samples: dict[str, list[float]] = {"hfrt": [], "raw": [], "floor": []}
            rounds = 10
            for _ in range(rounds):
                samples["hfrt"] += await timed_calls(one, args.calls // rounds)
                samples["raw"] += raw.block(args.calls // rounds)
                samples["floor"] += await floor.block(args.calls // rounds)
            calls_per_s = await pipelined(one, args.inflight, args.duration)
            fan = await timed_calls(echo.ping.call, max(500, args.calls // 5))
            bulk = ctl.stats()["controller_bulk_bytes"]
        finally:
            await ctl.shutdown_daemons()
            await launcher.stop()
            raw.close()
            floor.close()
            zctx.term()
    p50 = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    return {
        "hfrt_p50_us": p50["hfrt"],
        "hfrt_p99_us": pct(samples["hfrt"], 0.99) * 1e6,
        "hfrt_calls_per_s": calls_per_s,
        f"fanout{args.fanout}_p50_us": statistics.median(fan) * 1e6,
        "raw_zmq_p50_us": p50["raw"],
        "asyncio_zmq_floor_p50_us": p50["floor"],
        "controller_bulk_bytes": bulk,
    }


def ray_p50_us(n: int) -> float | None:
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        @ray.remote
        class Echo:
            def ping(self) -> str:
                return "pong"

        actor = Echo.remote()  # type: ignore[attr-defined]
        for _ in range(300):
            ray.get(actor.ping.remote())
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            ray.get(actor.ping.remote())
            samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1e6
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench latency", description=__doc__)
    p.add_argument("--calls", type=int, default=5000, help="round trips per measurement (split into 10 interleaved blocks)")
    p.add_argument("--fanout", type=int, default=4, help="daemons for the fan-out measurement")
    p.add_argument("--inflight", type=int, default=64, help="calls in flight for the throughput measurement")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of pipelined calls")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray reference even if Ray is installed")
    add_output_flags(p)
    args = p.parse_args(argv)
    configure_logging("warning")

    figures = run(measure(args))
    ray = None if args.no_ray else ray_p50_us(max(1000, args.calls // 2))
    hfrt, raw, floor = figures["hfrt_p50_us"], figures["raw_zmq_p50_us"], figures["asyncio_zmq_floor_p50_us"]
    result: dict[str, Any] = {
        **{k: round(v, 1) for k, v in figures.items()},
        "ray_p50_us": None if ray is None else round(ray, 1),
        "hfrt_vs_raw_p50": round(hfrt / raw, 2),
        "hfrt_vs_ray_p50": None if ray is None else round(hfrt / ray, 3),
        "floor_vs_raw_p50": round(floor / raw, 2),
        "hfrt_own_us": round(hfrt - floor, 1),
        "payload_bytes": len(payload()),
        "transport": "tcp loopback",
        "event_loop": "uvloop" if loop_factory() else "asyncio",
        **machine(),
    }
    ray_missing = "skipped (--no-ray)" if args.no_ray else "not installed"
    result["targets_met"] = targets_met(result)
    print("\n".join(report(result, inflight=args.inflight, fanout=args.fanout, ray_missing=ray_missing)))
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
