"""Adapter-only weight sync against full-weight sync: bytes per sync and sync time, LoRA vs full
weights, measured in one run on the same model.

Run: `hfrt bench lora-sync [--model smollm2-135m] [--rank 16] [--alpha 32] [--targets all-linear]
[--generator hf|vllm] [--syncs 5] [--json] [--out FILE]`. Two actor daemons (one training LoRA
adapters, one full weights) each publish a numbered version that a rollout daemon of their own
loads by handle, checksummed (roles/components/weight_sync.py), `--syncs` times each; and each actor's
own hybrid push (train → generate inside the daemon) is timed by a one-token rollout (the first). Reported:
median bytes and seconds per sync on both sides and their ratios (LoRA / full). It knows the actor
and rollout endpoints; nothing of how either moves bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine


def roles(model: str, lora: dict[str, Any], generator: str) -> dict[str, dict[str, Any]]:
    """A LoRA pair (actor + rollout) and a full-weight pair on `model`; fp32, one thread each."""
    vllm = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 32 << 20}
    common: dict[str, Any] = {"model": model, "threads": 1}
    gen: dict[str, Any] = {"generator": generator} | ({"vllm": vllm} if generator == "vllm" else {})
    actor = common | gen | {"engine": {"micro_batch_size": 4}}
    return {
        "actor_lora": {"impl": "actor", "options": actor | {"lora": lora}},
        "rollout_lora": {"impl": "rollout", "options": common | gen | {"lora": lora}},
        "actor_full": {"impl": "actor", "options": actor},
        "rollout_full": {"impl": "rollout", "options": common | gen},
    }


async def sync_times(actor: Any, rollout: Any, syncs: int) -> list[dict[str, float]]:
    """`syncs` versions published by `actor` and loaded by `rollout`: bytes, publish / load / total s."""
    out = []
    for version in range(syncs):
        start = time.perf_counter()
        [published] = await actor.publish_weights(version, timeout_s=600)
        [loaded] = await rollout.load_weights(published, timeout_s=600)
        total = time.perf_counter() - start
        out.append({"bytes": float(loaded["bytes"]), "publish_s": float(published["timing/publish_s"]),
                    "load_s": float(loaded["timing/load_s"]), "sync_s": total, "buckets": float(loaded["buckets"])})
        del published
    return out


async def hybrid_push(actor: Any) -> dict[str, float]:
    """The actor's own train → generate push inside its daemon (the first rollout pushes: nothing
    was pushed yet), read from a one-token rollout's meta."""
    from hfrt.flows.batches import prompts_handle

    batch = await actor.generate(prompts_handle({"prompt": ["2 + 2 ="]}), max_new_tokens=1, timeout_s=600)
    return {"pushed_bytes": float(batch.meta.get("reshard/pushed_mb", 0.0)) * 2**20,
            "push_s": float(batch.meta.get("timing/reshard_to_generate_s", 0.0))}


def med(rows: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 6)


def summarize(lora: list[dict[str, float]], full: list[dict[str, float]], params: dict[str, Any]) -> dict[str, Any]:
    """Medians of each side and the LoRA / full ratios."""
    result: dict[str, Any] = {"params": params}
    for name, rows in (("lora", lora), ("full", full)):
        result[name] = {key: med(rows, key) for key in rows[0]} | {"sync_s_all": [round(r["sync_s"], 4) for r in rows]}
    result["bytes_ratio"] = round(result["lora"]["bytes"] / result["full"]["bytes"], 5)
    result["sync_time_ratio"] = round(result["lora"]["sync_s"] / result["full"]["sync_s"], 4)
    return result


def measure(model: str, lora: dict[str, Any], generator: str, syncs: int) -> dict[str, Any]:
    from hfrt.flows import Flow
    from hfrt.session import run_flow
    from hfrt.wire.loop import run

    async def flow(ctl: Any, _config: dict[str, Any]) -> dict[str, Any]:
        import asyncio

        names = ("actor_lora", "rollout_lora", "actor_full", "rollout_full")
        a_lora, r_lora, a_full, r_full = await asyncio.gather(*(ctl.role(n, timeout_s=900) for n in names))
        lora_rows = await sync_times(a_lora, r_lora, syncs)
        full_rows = await sync_times(a_full, r_full, syncs)
        return {"lora": lora_rows, "full": full_rows, "hybrid": {"lora": await hybrid_push(a_lora), "full": await hybrid_push(a_full)}}

    with tempfile.TemporaryDirectory(prefix="hfrt-bench-lora-sync-") as run_dir:
        out = run(run_flow(Flow("bench-lora-sync", flow, roles(model, lora, generator)), run_dir=Path(run_dir), config={}))
    result = summarize(out["lora"], out["full"], {"model": model, "lora": lora, "generator": generator, "syncs": syncs})
    hybrid = out["hybrid"]
    result["hybrid_push"] = hybrid | {"bytes_ratio": round(hybrid["lora"]["pushed_bytes"] / max(hybrid["full"]["pushed_bytes"], 1.0), 5)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench lora-sync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="preset (tiny, smollm2-135m) or a Hugging Face model folder")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (scale alpha / rank)")
    p.add_argument("--targets", default="all-linear", help="peft target_modules: all-linear or comma-separated module names")
    p.add_argument("--generator", default="hf", choices=["hf", "vllm"], help="the rollout daemons' generation engine")
    p.add_argument("--syncs", type=int, default=5, help="syncs per side (medians are over these)")
    add_output_flags(p)
    args = p.parse_args(argv)
    if args.syncs < 1 or args.rank < 1:
        p.error("need --syncs >= 1 and --rank >= 1")
    from hfrt.log import configure as configure_logging

    configure_logging("warning")
    targets: Any = args.targets if args.targets == "all-linear" else [t for t in args.targets.split(",") if t]
    lora = {"rank": args.rank, "alpha": args.alpha, "target_modules": targets}
    result = measure(args.model, lora, args.generator, args.syncs) | machine()
    for side in ("lora", "full"):
        r = result[side]
        print(f"{side:<6} {r['bytes'] / 2**20:10.2f} MiB/sync  {r['sync_s']:8.3f} s/sync  (publish {r['publish_s']:.3f} s, load {r['load_s']:.3f} s)")
    print(f"LoRA / full: bytes {result['bytes_ratio']:.4f}, time {result['sync_time_ratio']:.4f}")
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
