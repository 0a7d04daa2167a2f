"""Latency benchmark: hfrt call round trip, pipelined throughput and fan-out, against raw pyzmq
REQ/REP and (when installed) a Ray actor call, all measured in one run on this machine.

Run: `hfrt bench latency [--json] [--out FILE]`. It starts its own daemons and reference servers
and knows nothing of RL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import deque
from typing import Any

from hfrt.deploy.base import expand
from hfrt.deploy.local import LocalLauncher
from hfrt.protocols import Call, Wire, new_key

from hfrt.controller import Controller
from hfrt.log import configure as configure_logging
from hfrt.loop import loop_factory, run

RAW_SERVER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.REP); port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    m = s.recv()
    if m == b"stop":
        s.send(b""); break
    s.send(m)
"""


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def payload_bytes() -> int:
    """Bytes of a signed no-op Call as hfrt sends it, so the raw reference moves the same size."""
    frames = Wire(new_key()).pack(Call(123456, "ping", [], {}, True))
    return sum(len(f) for f in frames)


def raw_zmq_p50_us(n: int, size: int) -> float:
    import zmq

    server = subprocess.Popen([sys.executable, "-c", RAW_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.connect(f"tcp://127.0.0.1:{port}")
        msg = b"x" * size
        for _ in range(500):
            sock.send(msg)
            sock.recv()
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            sock.send(msg)
            sock.recv()
            samples.append(time.perf_counter() - t)
        sock.send(b"stop")
        sock.recv()
        sock.close(0)
        ctx.term()
        return statistics.median(samples) * 1e6
    finally:
        server.wait(timeout=10)


def ray_p50_us(n: int) -> float | None:
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
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


async def hfrt_figures(n: int, fanout: int, inflight: int, duration_s: float) -> dict[str, float]:
    key = new_key()
    async with Controller("tcp://127.0.0.1:0", key) as ctl:
        launcher = LocalLauncher(log_level="warning")
        await launcher.start(expand("echo", fanout, "echo"), controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        try:
            echo = await ctl.role("echo", timeout_s=60)
            ping = echo.ping
            for _ in range(1000):
                await ping.call_one(0)
            samples = []
            for _ in range(n):
                t = time.perf_counter()
                await ping.call_one(0)
                samples.append(time.perf_counter() - t)

            window: deque[asyncio.Future[Any]] = deque()
            done = 0
            start = time.perf_counter()
            while time.perf_counter() - start < duration_s:
                for _ in range(256):
                    if len(window) >= inflight:
                        await window.popleft()
                        done += 1
                    window.append(ping.call_one(0))
            while window:
                await window.popleft()
                done += 1
            calls_per_s = done / (time.perf_counter() - start)

            fan = []
            for _ in range(200):
                await ping.call()
            for _ in range(max(500, n // 5)):
                t = time.perf_counter()
                await ping.call()
                fan.append(time.perf_counter() - t)
            bulk = ctl.stats()["controller_bulk_bytes"]
        finally:
            await ctl.shutdown_daemons()
            await launcher.stop()
    return {
        "hfrt_p50_us": statistics.median(samples) * 1e6,
        "hfrt_p99_us": pct(samples, 0.99) * 1e6,
        "hfrt_calls_per_s": calls_per_s,
        f"fanout{fanout}_p50_us": statistics.median(fan) * 1e6,
        "controller_bulk_bytes": bulk,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench latency", description=__doc__)
    p.add_argument("--calls", type=int, default=5000, help="sequential round trips per measurement")
    p.add_argument("--fanout", type=int, default=4, help="daemons for the fan-out measurement")
    p.add_argument("--inflight", type=int, default=64, help="calls in flight for the throughput measurement")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of pipelined calls")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray reference even if Ray is installed")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--out", help="also write the JSON result to this file")
    args = p.parse_args(argv)
    configure_logging("warning")

    figures = run(hfrt_figures(args.calls, args.fanout, args.inflight, args.duration))
    size = payload_bytes()
    raw = raw_zmq_p50_us(args.calls, size)
    ray = None if args.no_ray else ray_p50_us(max(1000, args.calls // 2))
    result: dict[str, Any] = {
        **{k: round(v, 1) for k, v in figures.items()},
        "raw_zmq_p50_us": round(raw, 1),
        "ray_p50_us": None if ray is None else round(ray, 1),
        "hfrt_vs_raw_p50": round(figures["hfrt_p50_us"] / raw, 2),
        "hfrt_vs_ray_p50": None if ray is None else round(figures["hfrt_p50_us"] / ray, 3),
        "payload_bytes": size,
        "transport": "tcp loopback",
        "event_loop": "uvloop" if loop_factory() else "asyncio",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    rows = [
        ("hfrt no-op round trip p50", result["hfrt_p50_us"], "µs"),
        ("hfrt no-op round trip p99", result["hfrt_p99_us"], "µs"),
        (f"hfrt pipelined ({args.inflight} in flight)", result["hfrt_calls_per_s"], "calls/s"),
        (f"hfrt fan-out to {args.fanout} daemons p50", result[f"fanout{args.fanout}_p50_us"], "µs"),
        ("raw sync pyzmq REQ/REP p50", result["raw_zmq_p50_us"], "µs"),
        ("Ray actor call p50", result["ray_p50_us"] if ray is not None else "n/a (not installed)", "µs"),
        ("hfrt / raw pyzmq (p50)", result["hfrt_vs_raw_p50"], "×  (target ≤ 2.5, stretch ≤ 1.5)"),
        ("hfrt / Ray (p50)", result["hfrt_vs_ray_p50"] if ray is not None else "n/a", "×  (target ≤ 0.25)"),
    ]
    for name, value, unit in rows:
        print(f"{name:<40} {value!s:>12} {unit}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
