"""Throughput and latency of the OpenAI-compatible endpoint: C concurrent HTTP clients (asyncio,
keep-alive, one connection each) send completions to one rollout daemon, for each C of --clients
(default 1, 16, 256), against a server that batches (TurnBatcher rounds) and, with --alone, one that
sends each request alone (batch_size 1), in interleaved rounds. Prints requests/s, latency p50/p99
and generate_turn calls; with --rss-requests N, the bench process's RSS (it hosts the server) before
and after N more requests.

It knows the endpoint's HTTP surface and the local launcher; nothing of training.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine
from hfrt.control.controller import Controller
from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.log import configure as configure_logging
from hfrt.protocols import new_key
from hfrt.serve.server import OpenAIServer
from hfrt.wire.loop import run


async def client(port: int, requests: int, max_tokens: int, index: int) -> list[float]:
    """One keep-alive connection sending `requests` completions one after another; their latencies."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    latencies = []
    try:
        for r in range(requests):
            body = json.dumps({"prompt": f"{index}+{r}=", "max_tokens": max_tokens, "temperature": 1.0}).encode()
            start = time.perf_counter()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"client {index}: {head[:80]!r}")
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
    finally:
        writer.close()
    return latencies


def _port(server: OpenAIServer) -> int:
    return int(getattr(server, "port", None) or server.http.port)  # type: ignore[attr-defined]


def rss_mib() -> float:
    """This process's resident set size (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one_round(server: OpenAIServer, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    calls = server.generate_calls
    start = time.perf_counter()
    per_client = await asyncio.gather(*(client(_port(server), requests, max_tokens, i) for i in range(clients)))
    wall = time.perf_counter() - start
    latencies = sorted(x for lat in per_client for x in lat)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {"req_per_s": len(latencies) / wall, "p50_ms": statistics.median(latencies) * 1e3, "p99_ms": p99 * 1e3,
            "calls": server.generate_calls - calls}


def _requests(args: argparse.Namespace, clients: int) -> int:
    """Requests per client in a round: at least --requests, and at least 64 requests in all."""
    return max(args.requests, -(-64 // clients))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    key = new_key()
    async with Controller("tcp://127.0.0.1:0", key) as ctl:
        launcher = LocalLauncher(log_level="warning")
        spec = DaemonSpec("rollout", impl="rollout", options={"model": args.model, "seed": 0})
        await launcher.start([spec], controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        try:
            rollout = await ctl.role("rollout", timeout_s=300)
            module, _, name = args.server.partition(":")
            server_class = getattr(importlib.import_module(module), name)
            batched = server_class(rollout, model=args.model, batch_size=64, flush_after_s=args.flush_ms / 1000, idle_flush=args.idle_flush)
            alone = server_class(rollout, model=args.model, batch_size=1, flush_after_s=0.0)
            rounds: dict[str, list[dict[str, float]]] = {}
            rss: dict[str, float] = {}
            async with batched, alone:
                await one_round(batched, 4, 1, args.max_tokens)  # warm-up
                for clients in args.clients:
                    for _ in range(args.rounds):
                        requests = _requests(args, clients)
                        rounds.setdefault(f"batched_c{clients}", []).append(await one_round(batched, clients, requests, args.max_tokens))
                        if args.alone:
                            rounds.setdefault(f"alone_c{clients}", []).append(await one_round(alone, clients, requests, args.max_tokens))
                if args.rss_requests:
                    rss["before_mib"] = rss_mib()
                    await one_round(batched, 64, -(-args.rss_requests // 64), 1)
                    rss["after_mib"] = rss_mib()
                    rss["requests"] = 64 * -(-args.rss_requests // 64)
        finally:
            await ctl.shutdown_daemons()
            await launcher.stop()
    figures: dict[str, Any] = {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for name, rs in rounds.items()}
    if rss:
        figures["rss"] = {k: round(v, 1) for k, v in rss.items()}
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench openai-serve", description=__doc__)
    p.add_argument("--model", default="tiny", help="model preset or folder of the rollout daemon")
    p.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16, 256],
                   help="comma-separated counts of concurrent HTTP clients (default 1,16,256)")
    p.add_argument("--requests", type=int, default=2, help="requests per client per round (at least 64 in a round)")
    p.add_argument("--alone", action="store_true", help="also measure a server that sends each request alone (batch_size 1)")
    p.add_argument("--rss-requests", type=int, default=0, help="then send this many requests and report the RSS before/after")
    p.add_argument("--label", default="", help="a name stamped on the result (e.g. which server stack)")
    p.add_argument("--server", default="hfrt.serve.server:OpenAIServer",
                   help="MODULE:CLASS of the server to measure (e.g. an earlier version's copy, for a before/after figure)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    p.add_argument("--flush-ms", type=float, default=20.0, help="the batching server's flush_after_s, in ms")
    p.add_argument("--idle-flush", action="store_true", help="the batching server sends at once when no call is in flight")
    add_output_flags(p)
    args = p.parse_args(argv)
    configure_logging("warning")
    figures = run(measure(args))
    result = {"label": args.label, **figures, "clients": args.clients, "max_tokens": args.max_tokens, **machine()}
    for name, f in figures.items():
        if name != "rss":
            print(f"{name:14s} {f['req_per_s']:8.1f} req/s   p50 {f['p50_ms']:8.1f} ms   p99 {f['p99_ms']:8.1f} ms   "
                  f"{f['calls']:5.0f} generate_turn calls per round")
    if "rss" in figures:
        r = figures["rss"]
        print(f"RSS of the serving process: {r['before_mib']} MiB, after {r['requests']:.0f} more requests {r['after_mib']} MiB")
    emit(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
