"""Streaming latency of the OpenAI-compatible endpoint: time to first token (TTFT) and the gaps
between token chunks (inter-token latency, ITL: each stream's mean gap, and the median and p99 of
all gaps — a chunked stream's tokens come 4 at once, so its median gap is ~0 and its mean and p99
tell) as an HTTP client receives them, for turns streamed
token by token from the rollout daemon (generate_turn_stream: one prefill, the KV cache kept for the
turn) against turns streamed in chunks of `stream_chunk_tokens` generate_turn calls (each a new
prefill of the whole context), in interleaved rounds on one rollout daemon, with C concurrent
streaming clients for each C of --clients. The daemon samples with ignore_eos so every turn is
max_tokens long.

It knows the endpoint's HTTP surface (server-sent events) and the local launcher; nothing of training.
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
from hfrt.log import configure as configure_logging
from hfrt.protocols import new_key
from hfrt.serve.server import OpenAIServer, ServerLimits
from hfrt.wire.loop import run


async def stream_once(port: int, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """One streamed completion on its own connection: (TTFT s, arrival times of each token chunk)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        start = time.perf_counter()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"stream refused: {head[:80]!r}")
        arrivals: list[float] = []
        while True:
            line = await reader.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: "):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("token_ids"):
                    arrivals.append(time.perf_counter())
        if len(arrivals) != max_tokens:
            raise RuntimeError(f"expected {max_tokens} token chunks, got {len(arrivals)}")
        return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    finally:
        writer.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_round(server: OpenAIServer, clients: int, prompt: str, max_tokens: int) -> dict[str, float]:
    """C clients each streaming one turn at once: TTFT, ITL and the per-stream token rate."""
    calls, streams = server.generate_calls, server.token_streams
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_once(server.port, f"{i}{prompt}", max_tokens) for i in range(clients)))
    wall = time.perf_counter() - start
    ttft = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_max_ms": max(ttft) * 1e3,
            "itl_mean_ms": statistics.median(statistics.fmean(r[1]) for r in results) * 1e3,
            "itl_p50_ms": statistics.median(gaps) * 1e3, "itl_p99_ms": _pct(gaps, 0.99) * 1e3,
            "tokens_per_s": clients * max_tokens / wall, "generate_turn_calls": server.generate_calls - calls,
            "token_streams": server.token_streams - streams}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    key = new_key()
    prompt = "7" * args.prompt_chars
    async with Controller("tcp://127.0.0.1:0", key) as ctl:
        launcher = LocalLauncher(log_level="warning")
        spec = DaemonSpec("rollout", impl="rollout", options={"model": args.model, "seed": 0, "sampling": {"ignore_eos": True}})
        await launcher.start([spec], controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        try:
            rollout = await ctl.role("rollout", timeout_s=600)
            servers = {"token": OpenAIServer(rollout, model=args.model, flush_after_s=0.0, idle_flush=True),
                       "chunks": OpenAIServer(rollout, model=args.model, flush_after_s=0.0, idle_flush=True,
                                              limits=ServerLimits(token_stream=False, stream_chunk_tokens=args.chunk_tokens))}
            rounds: dict[str, list[dict[str, float]]] = {}
            async with servers["token"], servers["chunks"]:
                for server in servers.values():  # warm-up
                    await one_round(server, 1, prompt, 4)
                for clients in args.clients:
                    for _ in range(args.rounds):
                        for name, server in servers.items():
                            rounds.setdefault(f"{name}_c{clients}", []).append(await one_round(server, clients, prompt, args.max_tokens))
        finally:
            await ctl.shutdown_daemons()
            await launcher.stop()
    figures: dict[str, Any] = {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for name, rs in rounds.items()}
    for clients in args.clients:
        token, chunks = figures[f"token_c{clients}"], figures[f"chunks_c{clients}"]
        figures[f"ratio_c{clients}"] = {k: round(token[k] / chunks[k], 3) for k in ("ttft_p50_ms", "itl_mean_ms", "itl_p99_ms", "tokens_per_s")
                                        if chunks[k]}
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench openai-stream", description=__doc__)
    p.add_argument("--model", default="tiny", help="model preset or folder of the rollout daemon")
    p.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4],
                   help="comma-separated counts of concurrent streaming clients (default 1,4)")
    p.add_argument("--prompt-chars", type=int, default=200, help="prompt length in characters (the tiny preset: one token each)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed turn")
    p.add_argument("--chunk-tokens", type=int, default=4, help="stream_chunk_tokens of the chunked server (the old path)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    add_output_flags(p)
    args = p.parse_args(argv)
    configure_logging("warning")
    figures = run(measure(args))
    result = {**figures, "model": args.model, "clients": args.clients, "prompt_chars": args.prompt_chars,
              "max_tokens": args.max_tokens, "chunk_tokens": args.chunk_tokens, **machine()}
    for name, f in figures.items():
        if not name.startswith("ratio"):
            print(f"{name:10s} TTFT p50 {f['ttft_p50_ms']:7.1f} ms   ITL mean {f['itl_mean_ms']:6.1f} ms  p50 {f['itl_p50_ms']:6.1f} ms  "
                  f"p99 {f['itl_p99_ms']:7.1f} ms   "
                  f"{f['tokens_per_s']:7.1f} tokens/s   {f['generate_turn_calls']:4.0f} generate_turn + {f['token_streams']:.0f} stream calls")
        else:
            print(f"{name:10s} token / chunks: " + "  ".join(f"{k} {v}" for k, v in f.items()))
    emit(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
