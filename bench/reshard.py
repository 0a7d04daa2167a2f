"""Reshard benchmark: the actor's training → generation weight transition through micro-DP groups
(roles/training/parallel/reshard.py) beside the naive "all-gather the full model on every rank, then slice",
for several (train, gen) layout pairs on 4 gloo processes, in one run.

Run: `hfrt bench reshard [--preset llama-small|qwen3-small|llama-110m|qwen3-110m|smollm2-135m ...]
[--repeats N] [--pairs t2p1d2:t1p1d4 ...] [--json] [--out FILE]`; several presets run one after
the other in the same spawn (default: llama-small and qwen3-small). Every rank starts from its training pieces (what an FSDP engine's forward
sees after its dp all-gather, which is measured apart as dp_gather_*). Per case: bytes_per_rank /
naive_bytes_per_rank (received by the busiest rank, counted from the collectives' tensors),
time_s / naive_time_s (median over repeats of the slowest rank), weights_equal (every rank's
generation pieces equal the exact slices of the full weights, for both methods), peak RSS above
the starting point, micro_dp. Pieces follow the model's transformers TP plan and DTensor's chunk
rule (tp_plan.split_dims / chunk_bounds), so any family with a plan runs. The presets are random
models built from a config, never downloaded: `llama-small` / `qwen3-small` (hidden 256, 4 layers,
8 heads, 4 kv heads, vocab 8192; Qwen3 with its q/k norms and an untied head), `llama-110m` /
`qwen3-110m` (hidden 768, 12 layers, 12 heads, 4 kv heads, vocab 32000), for timings less
dominated by latency.

`--actor` measures the actor's own transition instead (hybrid.ReshardHybrid as
actor_layout._resharding_hybrid builds it, over the TP engine at the training layout): per pair, the streamed transition whose generation model adopts the
resharded pieces beside the previous one (clone the whole dp-gathered shard, exchange, wake the
generation model, copy into it), alternating, each from the training state: peak RSS above that
state (median of the busiest rank), the storage the generation model holds beyond the training
parameters, and time. JSON: `actor_cases` with `train`, `gen`, `peak_rss_delta_mb`,
`clone_peak_rss_delta_mb`, `added_mb`, `clone_added_mb`, `gen_shard_mb`, `time_s`, `clone_time_s`,
`weights_equal`.

`--vllm` measures the push into vLLM at a generation tp instead: micro-DP pieces presented
full-shaped to vLLM's loaders against today's full blocks (bench/reshard_vllm.py; JSON `vllm_cases`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine, spawn_ranks

PAIRS = ["t2p1d2:t1p1d4", "t2p1d2:t2p1d2", "t4p1d1:t2p1d2", "t1p1d4:t2p1d2", "t1p2d2:t1p1d4", "t2p2d1:t2p1d2"]
WORLD = 4


PRESETS = ("llama-small", "qwen3-small", "llama-110m", "qwen3-110m", "smollm2-135m", "tiny")


def build_model(preset: str) -> Any:
    """The full model every rank cuts its pieces from (seeded, the same on every rank)."""
    import torch

    family, _, size = preset.partition("-")
    if family in ("llama", "qwen3") and size in ("small", "110m"):
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

        dims: dict[str, Any] = (
            dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, head_dim=32)
            if size == "small"
            else dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, head_dim=64)
        )  # fmt: skip
        cls = LlamaConfig if family == "llama" else Qwen3Config
        config = cls(num_key_value_heads=4, tie_word_embeddings=False, **dims)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)
    from hfrt.roles.models import ModelConfig, load_model

    return load_model(ModelConfig(preset))


def split_dims_at(model: Any, tp: int, mesh: Any) -> dict[str, int | None]:
    """Each parameter's split dim under the model's TP plan at `tp` (read from a meta copy sharded
    over a size-`tp` mesh dimension; nothing is allocated)."""
    from hfrt.roles.training.parallel import tp_generation, tp_plan

    if tp == 1:
        return {}
    return tp_plan.split_dims(tp_generation.empty_tp_model(model.config, mesh, device="meta"))


def _pieces(full: dict[str, Any], layout: Any, coords: Any, dims: dict[str, int | None], num_layers: int) -> dict[str, Any]:
    from hfrt.roles.training.parallel.stages import holds
    from hfrt.roles.training.parallel.tp_plan import chunk_bounds

    out = {}
    for n, t in full.items():
        if not holds(n, num_layers, layout.pp, coords.pp):
            continue
        d = dims.get(n)
        if d is not None and layout.tp > 1:
            a, b = chunk_bounds(t.shape[d], layout.tp, coords.tp)
            t = t.narrow(d, a, b - a)
        out[n] = t.clone()
    return out


def tp_meshes() -> dict[int, Any]:
    """Meshes whose "tp" dimension has size 2 and 4 over the 4 ranks (collective)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    return {
        2: DeviceMesh("cpu", torch.arange(WORLD).reshape(2, 2), mesh_dim_names=("x", "tp"))["tp"],
        4: DeviceMesh("cpu", torch.arange(WORLD).reshape(1, 4), mesh_dim_names=("x", "tp"))["tp"],
    }


def run_case(rank: int, model: Any, full: dict[str, Any], meshes: dict[int, Any], pair: str, repeats: int) -> dict[str, Any]:
    """One layout pair on this rank: dp gather once, then alternate reshard / naive `repeats` times."""
    import torch
    import torch.distributed as dist

    from hfrt.roles.generation.hybrid import rss_mb
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.reshard import Resharder, dp_gather, naive_to_generation
    from hfrt.roles.training.parallel.reshard_plan import Params

    train_s, gen_s = pair.split(":")
    train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
    layers = int(model.config.num_hidden_layers)
    params = Params({n: tuple(t.shape) for n, t in full.items()}, split_dims_at(model, train.tp, meshes.get(train.tp)),
                    split_dims_at(model, gen.tp, meshes.get(gen.tp)), layers)  # fmt: skip
    groups = L.new_groups(train, gen, rank)
    c = L.train_coords(train, rank)
    pieces = _pieces(full, train, c, params.train_dims, layers)
    pieces, dp_stats = dp_gather(pieces, groups.train_dp, train.dp, c.dp)
    g, _ = L.gen_coords(train, gen, rank)
    want = _pieces(full, gen, g, params.gen_dims, layers)
    r = Resharder(train, gen, rank, params, groups)
    rows: dict[str, list[float]] = {"time": [], "naive_time": [], "peak": [], "naive_peak": []}
    equal = naive_equal = True
    stats = nstats = None
    for _ in range(repeats):
        dist.barrier()
        base = rss_mb()
        out = r.to_generation(pieces)
        stats = r.last
        equal = equal and sorted(out) == sorted(want) and all(torch.equal(out[n], want[n]) for n in want)
        r.to_train()
        del out
        rows["time"].append(stats.time_s)
        rows["peak"].append(stats.peak_rss_mb - base)
        dist.barrier()
        base = rss_mb()
        naive, nstats = naive_to_generation(train, gen, rank, params, pieces, groups)
        naive_equal = naive_equal and all(torch.equal(naive[n], want[n]) for n in want)
        del naive
        rows["naive_time"].append(nstats.time_s)
        rows["naive_peak"].append(nstats.peak_rss_mb - base)
    assert stats is not None and nstats is not None
    return {
        "micro_dp": L.micro_dp_size(train, gen),
        "received": stats.bytes_received, "sent": stats.bytes_sent,
        "naive_received": nstats.bytes_received, "naive_sent": nstats.bytes_sent,
        "dp_gather": dp_stats.bytes_received, "dp_gather_time": dp_stats.time_s,
        "gen_bytes": sum(t.numel() * t.element_size() for t in want.values()),
        "shared": stats.shared, "fallback": len(r.fallback), "equal": equal, "naive_equal": naive_equal, **rows,
    }  # fmt: skip


def _clone_then_copy(hybrid: Any) -> float:
    """The transition before streaming/adoption (the reference): the whole dp-gathered training
    shard cloned, exchanged, the generation model woken (allocated) and the pieces copied in.
    Returns its peak RSS, MiB."""
    from hfrt.roles.generation.hybrid import PeakRSS, Phase

    with PeakRSS() as peak:
        hybrid.gen.wake()
        pieces = hybrid.resharder.to_generation(hybrid.train.local_pieces(), copy=True)
        hybrid.gen.load_weights(pieces.items())
        hybrid.resharder.to_train()
        del pieces
    hybrid.phase = Phase.GENERATE
    return peak.peak_mb


def _added_mb(hybrid: Any) -> float:
    """Storage the generation model holds that is not a training parameter's, MiB."""
    from torch.distributed.tensor import DTensor

    training = {(p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in hybrid.train.model.parameters()}
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in hybrid.gen.local_parameters().values()}
    return sum(n for ptr, n in storages.items() if ptr not in training) / 2**20


def run_actor_case(rank: int, model_fn: Any, pair: str, repeats: int) -> dict[str, Any]:
    """The actor's transition at one layout pair: streamed + adopted vs clone-then-copy."""
    import gc
    import time
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from hfrt.daemon.base import DaemonContext
    from hfrt.roles.actor_layout import _resharding_hybrid
    from hfrt.roles.generation.hybrid import rss_mb
    from hfrt.roles.training.engines import EngineConfig, build_train_engine
    from hfrt.roles.training.parallel import layout as L

    train_s, gen_s = pair.split(":")
    train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
    model = model_fn()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine: Any = build_train_engine(model, EngineConfig(backend="tp", tp=train.tp, pp=train.pp, trainable=False))
    context = DaemonContext("actor", rank, WORLD, options={})
    hybrid = _resharding_hybrid(context, engine, SimpleNamespace(pad_token_id=0, eos_token_id=None), torch.float32, train, gen)
    g, _ = L.gen_coords(train, gen, rank)
    want = _pieces(full, gen, g, hybrid.resharder.params.gen_dims, int(model.config.num_hidden_layers))
    del full
    hybrid.gen.sleep()
    rows: dict[str, list[float]] = {"peak": [], "clone_peak": [], "time": [], "clone_time": []}
    added = clone_added = 0.0
    equal = True
    for _ in range(repeats):
        for method in (("stream", "clone") if len(rows["time"]) % 2 else ("clone", "stream")):
            gc.collect()
            dist.barrier()
            base, start = rss_mb(), time.perf_counter()
            if method == "stream":
                peak = hybrid.to_generate()["memory/reshard_to_generate_peak_rss_mb"]
            else:
                peak = _clone_then_copy(hybrid)
            elapsed = time.perf_counter() - start
            got = hybrid.gen.local_parameters()
            equal = equal and sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
            if method == "stream":
                added = _added_mb(hybrid)
            else:
                clone_added = _added_mb(hybrid)
            del got
            hybrid.to_train()
            prefix = "" if method == "stream" else "clone_"
            rows[prefix + "peak"].append(peak - base)
            rows[prefix + "time"].append(elapsed)
    return {
        "gen_mb": sum(t.numel() * t.element_size() for t in want.values()) / 2**20,
        "added": added, "clone_added": clone_added, "equal": equal, **rows,
    }  # fmt: skip


def slowest_per_repeat(ranks: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[float]]:
    """For each key, the slowest (largest) rank's value in each repeat."""
    repeats = len(ranks[0]["time"])
    return {k: [max(r[k][i] for r in ranks) for i in range(repeats)] for k in keys}


def summarize_actor(key: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    preset, pair = key.split("|")
    train, gen = pair.split(":")
    slowest = slowest_per_repeat(ranks, ("peak", "clone_peak", "time", "clone_time"))
    return {
        "preset": preset,
        "train": train,
        "gen": gen,
        "gen_shard_mb": round(max(r["gen_mb"] for r in ranks), 2),
        "peak_rss_delta_mb": round(statistics.median(slowest["peak"]), 2),
        "clone_peak_rss_delta_mb": round(statistics.median(slowest["clone_peak"]), 2),
        "added_mb": round(max(r["added"] for r in ranks), 2),
        "clone_added_mb": round(max(r["clone_added"] for r in ranks), 2),
        "time_s": statistics.median(slowest["time"]),
        "clone_time_s": statistics.median(slowest["clone_time"]),
        "weights_equal": all(r["equal"] for r in ranks),
    }


def rank_main(
    rank: int, port: int, out_dir: str, presets: list[str], pairs: list[str], repeats: int, actor: bool = False
) -> None:
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        from hfrt.roles.training.engines import init_distributed

        init_distributed(rank, WORLD, "127.0.0.1", port)
        if actor:
            result = {"ok": True, "cases": {f"{preset}|{p}": run_actor_case(rank, lambda pr=preset: build_model(pr), p, repeats)
                                            for preset in presets for p in pairs}}  # fmt: skip
            raise _Done
        meshes = tp_meshes()
        result = {"ok": True, "cases": {}}
        for preset in presets:
            model = build_model(preset)
            full = {n: p.detach() for n, p in model.named_parameters()}
            for pair in pairs:
                result["cases"][f"{preset}|{pair}"] = run_case(rank, model, full, meshes, pair, repeats)
            del model, full
    except _Done:
        pass
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    import torch.distributed as dist

    if result["ok"] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


class _Done(Exception):
    """The actor mode's early exit from rank_main's try block."""


def spawn(presets: list[str], pairs: list[str], repeats: int, actor: bool = False) -> list[dict[str, Any]]:
    return spawn_ranks(rank_main, (presets, pairs, repeats, actor), WORLD, "hfrt-bench-reshard-")


def summarize(key: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One case across ranks: the busiest rank's bytes, the slowest rank's median time."""
    preset, pair = key.split("|")
    train, gen = pair.split(":")
    slowest = slowest_per_repeat(ranks, ("time", "naive_time", "peak", "naive_peak"))
    return {
        "preset": preset,
        "train": train,
        "gen": gen,
        "micro_dp": ranks[0]["micro_dp"],
        "bytes_per_rank": max(r["received"] for r in ranks),
        "naive_bytes_per_rank": max(r["naive_received"] for r in ranks),
        "bytes_sent_per_rank": max(r["sent"] for r in ranks),
        "naive_bytes_sent_per_rank": max(r["naive_sent"] for r in ranks),
        "dp_gather_bytes_per_rank": max(r["dp_gather"] for r in ranks),
        "gen_shard_bytes_per_rank": max(r["gen_bytes"] for r in ranks),
        "time_s": statistics.median(slowest["time"]),
        "naive_time_s": statistics.median(slowest["naive_time"]),
        "peak_rss_delta_mb": round(statistics.median(slowest["peak"]), 2),
        "naive_peak_rss_delta_mb": round(statistics.median(slowest["naive_peak"]), 2),
        "shared_tensors_per_rank": min(r["shared"] for r in ranks),
        "fallback_tensors": max(r["fallback"] for r in ranks),
        "weights_equal": all(r["equal"] and r["naive_equal"] for r in ranks),
    }


def targets(case: dict[str, Any]) -> dict[str, bool]:
    """The re-layout's targets for one case: no slower than the naive push, at most 1/t_g of its
    bytes per rank when micro-DP > 1, and zero bytes when the layouts are equal."""
    t_g = int(case["gen"][1 : case["gen"].index("p")])
    out = {"time_le_naive": case["time_s"] <= case["naive_time_s"]}
    if case["micro_dp"] > 1:
        out["bytes_le_naive_over_tg"] = case["bytes_per_rank"] <= case["naive_bytes_per_rank"] / t_g
    if case["train"] == case["gen"]:
        out["equal_layout_zero_bytes"] = case["bytes_per_rank"] == 0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["llama-small", "qwen3-small"], choices=PRESETS,
                   help="models, run one after the other (random ones built from a config; smollm2-135m from its package)")
    p.add_argument("--repeats", type=int, default=7, help="transitions per method and case (median reported)")
    p.add_argument("--pairs", nargs="+", help="train:gen layout pairs, e.g. t2p1d2:t1p1d4 (4 ranks; default: all above)")
    p.add_argument("--actor", action="store_true", help="measure the actor's transition (stream + adopt vs clone + copy)")
    p.add_argument("--vllm", action="store_true", help="measure the push into vLLM at a generation tp: micro-DP pieces vs full blocks (bench/reshard_vllm.py)")
    add_output_flags(p)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.vllm:
        return _vllm(p, args)
    args.pairs = args.pairs or PAIRS
    from hfrt.roles.training.parallel.layout import Layout, check_pair

    for pair in args.pairs:
        try:
            train, gen = (Layout.parse(s) for s in pair.split(":"))
            train.check(WORLD, where=f"--pairs {pair}")
            check_pair(train, gen)
            if gen.pp != 1:
                raise ValueError(f"--pairs {pair}: generation runs with one pipeline stage (pp=1)")
        except ValueError as e:
            p.error(str(e))
    if args.actor:
        # every large allocation mmapped, so freed memory leaves RSS and the peaks compare; glibc's
        # default keeps freed tensors in the heap, and the next transition reuses them unseen
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        ranks = spawn(args.preset, args.pairs, args.repeats, actor=True)
        keys = [f"{preset}|{pair}" for preset in args.preset for pair in args.pairs]
        actor_cases = [summarize_actor(k, [r["cases"][k] for r in ranks]) for k in keys]
        result = {"bench": "reshard-actor", "preset": args.preset, "world": WORLD, "backend": "gloo",
                  "repeats": args.repeats, "actor_cases": actor_cases, **machine()}  # fmt: skip
        if not args.json:
            print(f"{'preset':>12} {'train':>7} {'gen':>7} {'shardMB':>8} {'rssΔMB':>7} {'cloneΔ':>7} {'addMB':>7} {'cloneAdd':>8} {'time_s':>8} {'clone_s':>8} equal")
            for c in actor_cases:
                print(
                    f"{c['preset']:>12} {c['train']:>7} {c['gen']:>7} {c['gen_shard_mb']:>8.1f} {c['peak_rss_delta_mb']:>7.1f} "
                    f"{c['clone_peak_rss_delta_mb']:>7.1f} {c['added_mb']:>7.1f} {c['clone_added_mb']:>8.1f} "
                    f"{c['time_s']:>8.4f} {c['clone_time_s']:>8.4f} {c['weights_equal']}"
                )
        emit(result, args)
        return 0
    ranks = spawn(args.preset, args.pairs, args.repeats)
    keys = [f"{preset}|{pair}" for preset in args.preset for pair in args.pairs]
    cases = [summarize(k, [r["cases"][k] for r in ranks]) for k in keys]
    for case in cases:
        case["targets"] = targets(case)
    result = {"bench": "reshard", "preset": args.preset, "world": WORLD, "backend": "gloo", "repeats": args.repeats, "cases": cases, **machine()}
    if not args.json:
        print(f"{'preset':>12} {'train':>7} {'gen':>7} {'m':>2} {'bytes/rank':>11} {'naive':>11} {'time_s':>9} {'naive_s':>9} {'rssΔMB':>7} {'naiveΔ':>7} equal")
        for c in cases:
            print(
                f"{c['preset']:>12} {c['train']:>7} {c['gen']:>7} {c['micro_dp']:>2} {c['bytes_per_rank']:>11} {c['naive_bytes_per_rank']:>11} "
                f"{c['time_s']:>9.5f} {c['naive_time_s']:>9.5f} {c['peak_rss_delta_mb']:>7.1f} {c['naive_peak_rss_delta_mb']:>7.1f} {c['weights_equal']}"
            )
    emit(result, args)
    return 0


def _vllm(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--vllm`: pieces vs full blocks into vLLM (bench/reshard_vllm.py), one spawn per case."""
    from hfrt.bench import reshard_vllm

    try:
        result = reshard_vllm.run(args.preset, args.pairs or reshard_vllm.PAIRS, args.repeats, build_model, header=not args.json)
    except ValueError as e:
        p.error(str(e))
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
