"""Throughput of the OpenAI-compatible endpoint with and without batching: C concurrent HTTP clients
(asyncio, keep-alive, one connection each) send completions to one rollout daemon; the same clients
against a server that batches (TurnBatcher rounds) and one that sends each request alone
(batch_size 1), in interleaved rounds. Prints requests/s, latency p50 and generate_turn calls.

It knows the endpoint's HTTP surface and the local launcher; nothing of training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine
from hfrt.control.controller import Controller
from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.flows.agent.openai.server import OpenAIServer
from hfrt.log import configure as configure_logging
from hfrt.protocols import new_key
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


async def one_round(server: OpenAIServer, args: argparse.Namespace) -> dict[str, float]:
    calls = server.generate_calls
    start = time.perf_counter()
    per_client = await asyncio.gather(*(client(server.http.port, args.requests, args.max_tokens, i) for i in range(args.clients)))
    wall = time.perf_counter() - start
    latencies = [x for lat in per_client for x in lat]
    return {"req_per_s": len(latencies) / wall, "p50_ms": statistics.median(latencies) * 1e3,
            "calls": server.generate_calls - calls}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    key = new_key()
    async with Controller("tcp://127.0.0.1:0", key) as ctl:
        launcher = LocalLauncher(log_level="warning")
        spec = DaemonSpec("rollout", impl="rollout", options={"model": args.model, "seed": 0})
        await launcher.start([spec], controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        try:
            rollout = await ctl.role("rollout", timeout_s=300)
            batched = OpenAIServer(rollout, model=args.model, batch_size=64, flush_after_s=args.flush_ms / 1000, idle_flush=args.idle_flush)
            alone = OpenAIServer(rollout, model=args.model, batch_size=1, flush_after_s=0.0)
            rounds: dict[str, list[dict[str, float]]] = {"batched": [], "alone": []}
            async with batched, alone:
                await one_round(batched, argparse.Namespace(**{**vars(args), "requests": 1}))  # warm-up
                for _ in range(args.rounds):
                    rounds["batched"].append(await one_round(batched, args))
                    rounds["alone"].append(await one_round(alone, args))
        finally:
            await ctl.shutdown_daemons()
            await launcher.stop()
    return {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for name, rs in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench openai-serve", description=__doc__)
    p.add_argument("--model", default="tiny", help="model preset or folder of the rollout daemon")
    p.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients")
    p.add_argument("--requests", type=int, default=4, help="requests per client per round")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    p.add_argument("--flush-ms", type=float, default=20.0, help="the batching server's flush_after_s, in ms")
    p.add_argument("--idle-flush", action="store_true", help="the batching server sends at once when no call is in flight")
    add_output_flags(p)
    args = p.parse_args(argv)
    configure_logging("warning")
    figures = run(measure(args))
    ratio = figures["batched"]["req_per_s"] / figures["alone"]["req_per_s"]
    result = {**figures, "batched_vs_alone_req_per_s": round(ratio, 2), "clients": args.clients, "requests": args.requests,
              "max_tokens": args.max_tokens, **machine()}
    for name in ("batched", "alone"):
        f = figures[name]
        print(f"{name:8s} {f['req_per_s']:8.1f} req/s   p50 {f['p50_ms']:8.1f} ms   {f['calls']:5.0f} generate_turn calls per round")
    print(f"batched / alone throughput: {ratio:.2f}x  ({args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens})")
    emit(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
