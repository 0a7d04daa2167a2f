"""Transfer benchmark: tensor bandwidth between two local daemons for every backend available,
against an in-process copy into a preallocated tensor measured in the same run, plus a
DP=2 → DP=1 → DP=2 resharding of a 64-row batch.

Run: `hfrt bench transfer [--json] [--out FILE]`. Bandwidth is the receiver's time to pull the
tensor into a preallocated tensor of its own (so every backend does the same useful work). It
starts its own probe daemons and knows nothing of RL.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine
from hfrt.control.controller import Controller
from hfrt.deploy.launchers.base import expand
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.log import configure as configure_logging
from hfrt.protocols import new_key
from hfrt.wire.loop import run

SIZES = {"1MB": 2**20, "64MB": 64 * 2**20, "512MB": 512 * 2**20}
#: backend name in results → the transfer backend the receiver is told to use, per tensor device
BACKENDS = {
    "cpu": {"shm": "shm", "gloo": "dist", "zmq": "zmq"},
    "cuda": {"cuda_ipc": "cuda_ipc", "nccl": "dist"},
}


async def bandwidth(ctl: Controller, sizes: dict[str, int], repeats: int, device: str) -> dict[str, float]:
    src, dst = await asyncio.gather(ctl.role("src"), ctl.role("dst"))
    backends = dict(BACKENDS[device])
    if device == "cuda" and not await src.gpus.call_one(0) >= 2:
        del backends["nccl"]  # NCCL refuses two ranks on one GPU
    else:
        await ctl.form_data_plane("nccl" if device == "cuda" else "gloo")
    out: dict[str, float] = {}
    for label, nbytes in sizes.items():
        copy = await dst.memcpy.call_one(0, nbytes, repeats, device)
        out[f"memcpy_{label}_GBps"] = nbytes / statistics.median(copy) / 1e9
        handle = await src.tensor.call_one(0, nbytes, device)
        for name, backend in backends.items():
            timed = await dst.timed_pull.call_one(0, handle, backend, repeats)
            out[f"{name}_{label}_GBps"] = nbytes / statistics.median(timed["seconds"]) / 1e9
        del handle
        ctl.free_now()
    return out


async def reshard(ctl: Controller, rounds: int) -> dict[str, float]:
    two, one = await asyncio.gather(ctl.role("two"), ctl.role("one"))
    rows = list(range(64))
    to_one, to_two = [], []
    for _ in range(rounds):
        batch = await two.make(rows, width=1024)
        t = time.perf_counter()
        batch = await one.reshard(batch)
        to_one.append(time.perf_counter() - t)
        t = time.perf_counter()
        batch = await two.reshard(batch)
        to_two.append(time.perf_counter() - t)
    seen = await two.inspect(batch)
    assert [r["id"] for r in seen] == rows, "row order changed in resharding"
    return {
        "reshard_dp2_to_dp1_ms": statistics.median(to_one) * 1e3,
        "reshard_dp1_to_dp2_ms": statistics.median(to_two) * 1e3,
        "reshard_batch_bytes": float(batch.nbytes),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    key = new_key()
    sizes = {k: v for k, v in SIZES.items() if k in args.sizes}
    specs = expand("src", 1, "probe") + expand("dst", 1, "probe") + expand("two", 2, "probe") + expand("one", 1, "probe")
    async with Controller("tcp://127.0.0.1:0", key) as ctl:
        launcher = LocalLauncher(log_level="warning")
        await launcher.start(specs, controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        try:
            figures = await bandwidth(ctl, sizes, args.repeats, args.device)
            if args.device == "cpu":
                figures.update(await reshard(ctl, args.repeats))
            bulk = ctl.stats()["controller_bulk_bytes"]
        finally:
            await ctl.shutdown_daemons()
            await launcher.stop()
    return {**{k: round(v, 3) for k, v in figures.items()}, "controller_bulk_bytes": bulk}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench transfer", description=__doc__)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="tensor sizes to measure")
    p.add_argument("--repeats", type=int, default=5, help="transfers per size and backend (the median is reported)")
    p.add_argument("--device", default="cpu", choices=list(BACKENDS), help="where the tensors live (cuda: CUDA IPC and NCCL)")
    add_output_flags(p)
    args = p.parse_args(argv)
    configure_logging("warning")
    result: dict[str, Any] = run(measure(args))
    names = ("memcpy", *(n for n in BACKENDS[args.device] if f"{n}_{next(iter(args.sizes))}_GBps" in result))
    first = names[1]
    for label in SIZES:
        if f"memcpy_{label}_GBps" in result:
            result[f"{first}_vs_memcpy_{label}"] = round(result[f"{first}_{label}_GBps"] / result[f"memcpy_{label}_GBps"], 2)
    result.update(machine(), device=args.device)
    print(f"{'size':<8}" + "".join(f"{n:>12}" for n in names) + "   GB/s")
    for label in SIZES:
        if f"memcpy_{label}_GBps" in result:
            print(f"{label:<8}" + "".join(f"{result[f'{n}_{label}_GBps']:>12.2f}" for n in names))
    print(f"{first} / in-process copy at 64MB: {result.get(f'{first}_vs_memcpy_64MB', 'n/a')}×  (target ≥ 0.6)")
    if "reshard_dp2_to_dp1_ms" in result:
        print(f"reshard 64 rows DP2→DP1: {result['reshard_dp2_to_dp1_ms']:.1f} ms, DP1→DP2: {result['reshard_dp1_to_dp2_ms']:.1f} ms")
    print(f"bytes through the controller: {result['controller_bulk_bytes']}  (target 0)")
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
