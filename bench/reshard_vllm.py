"""`hfrt bench reshard --vllm`: the actor's push into vLLM at a generation tp, by micro-DP pieces
(roles/generation/vllm_pieces.py) against today's full blocks (HybridEngine: every rank gathers the
full weights over tp and pp and vLLM's loaders keep its slice), on 4 gloo processes that are both
the TP training engine and one vLLM engine (external_launcher, tp = t_g, dp = 4 / t_g).

One spawn per (preset, pair) — a process holds one vLLM engine. Per case: bytes each rank received
over the collectives during the push (counted by wrapping torch.distributed's all_gather and
broadcast, which both paths use; FSDP's dp gather is all_gather_into_tensor, paid by both and not
counted), the bytes handed to vLLM's loaders, the push time (timing/reshard_to_generate_s) and its
peak RSS above the starting point, alternating the two methods `repeats` times (median of the
slowest / busiest rank); then greedy tokens and log-probs after each method's last push, which must
be equal. The checkpoint vLLM starts from is the preset's seed-0 model; the training engine holds
other weights, so a push that did not land shows. JSON: `vllm_cases`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from hfrt.bench.common import machine, spawn_ranks

PAIRS = ["t2p1d2:t2p1d2", "t2p2d1:t2p1d2", "t1p1d4:t2p1d2", "t4p1d1:t4p1d1"]
WORLD = 4
PROMPTS = [[5, 17, 40, 9], [100, 3, 77]]


def write_checkpoint(model: Any, folder: Path) -> None:
    """`model` as a Hugging Face folder vLLM loads, with the tiny preset's tokenizer files."""
    from hfrt.roles.models import resolve_model_dir

    model.save_pretrained(folder)
    for f in Path(resolve_model_dir("tiny", 0)).iterdir():
        if "token" in f.name:
            shutil.copy(f, folder)


class Counter:
    """Bytes this rank receives through torch.distributed.all_gather / broadcast while installed."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.received = 0
        self._dist = dist
        self._all_gather, self._broadcast = dist.all_gather, dist.broadcast

        def all_gather(out: list[Any], tensor: Any, group: Any = None, async_op: bool = False) -> Any:
            me = dist.get_rank(group)
            self.received += sum(t.numel() * t.element_size() for i, t in enumerate(out) if i != me)
            return self._all_gather(out, tensor, group=group, async_op=async_op)

        def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False, **kw: Any) -> Any:
            if dist.get_rank() != src:
                self.received += tensor.numel() * tensor.element_size()
            return self._broadcast(tensor, src=src, group=group, async_op=async_op, **kw)

        dist.all_gather, dist.broadcast = all_gather, broadcast  # type: ignore[assignment]


def rank_main(rank: int, port: int, out_dir: str, model_dir: str, pair: str, repeats: int) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        result = {"ok": True, **run_case(rank, port, model_dir, pair, repeats)}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


def run_case(rank: int, port: int, model_dir: str, pair: str, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hfrt.roles.generation.hf import SamplingParams
    from hfrt.roles.generation.hybrid import HybridEngine, rss_mb
    from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine
    from hfrt.roles.generation.vllm_pieces import piece_hybrid
    from hfrt.roles.training.engines import EngineConfig, build_train_engine, init_distributed
    from hfrt.roles.training.parallel import layout as L

    init_distributed(rank, WORLD, "127.0.0.1", port)
    train, gen = (L.Layout.parse(s) for s in pair.split(":"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():  # other weights than vLLM's checkpoint, the same on every rank
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    engine: Any = build_train_engine(model, EngineConfig(backend="tp", tp=train.tp, pp=train.pp, trainable=False))
    vcfg = VLLMConfig(model_dir=model_dir, dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**24, max_num_seqs=4,
                      tensor_parallel_size=gen.tp, data_parallel_size=gen.dp)  # fmt: skip
    vllm = VLLMGenerationEngine(vcfg, pad_token_id=0)
    hybrids = {"pieces": piece_hybrid(rank, engine, vllm, train, gen), "full": HybridEngine(engine, vllm)}
    counter = Counter()
    rows: dict[str, list[float]] = {k: [] for k in ("time", "naive_time", "peak", "naive_peak", "bytes", "naive_bytes")}
    pushed: dict[str, float] = {}
    stats_bytes = -1.0
    for i in range(repeats):
        for method in ("pieces", "full") if i % 2 == 0 else ("full", "pieces"):
            hybrid = hybrids[method]
            hybrid.forget_push()  # same weights as the last push: push anyway
            dist.barrier()
            counter.received, base = 0, rss_mb()
            metrics = hybrid.to_generate()
            prefix = "" if method == "pieces" else "naive_"
            rows[prefix + "time"].append(metrics["timing/reshard_to_generate_s"])
            rows[prefix + "peak"].append(metrics["memory/reshard_to_generate_peak_rss_mb"] - base)
            rows[prefix + "bytes"].append(float(counter.received))
            pushed[method] = metrics["reshard/pushed_mb"]
            if method == "pieces":
                stats_bytes = metrics["reshard/bytes_received"]
            hybrid.to_train()
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, seed=3)
    outs = {m: h.generate(PROMPTS, params)[0] for m, h in hybrids.items()}
    vllm.close()
    mask = outs["pieces"]["response_mask"].bool()
    g, _ = L.gen_coords(train, gen, rank)
    return {
        **rows,
        "micro_dp": L.micro_dp_size(train, gen),
        "stats_bytes": stats_bytes,
        "pushed_mb": pushed["pieces"], "naive_pushed_mb": pushed["full"],
        "whole": list(hybrids["pieces"].whole),  # type: ignore[attr-defined]
        "tokens_equal": bool(torch.equal(outs["pieces"]["responses"], outs["full"]["responses"])),
        "logprob_diff": float((outs["pieces"]["log_probs"] - outs["full"]["log_probs"])[mask].abs().max()),
        "gen_tp_rank": g.tp,
    }  # fmt: skip


def spawn(model_dir: str, pair: str, repeats: int) -> list[dict[str, Any]]:
    return spawn_ranks(rank_main, (model_dir, pair, repeats), WORLD, "hfrt-bench-reshard-vllm-")


def summarize(preset: str, pair: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One case across ranks: the busiest rank's bytes, the slowest rank's median time and peak."""
    train, gen = pair.split(":")
    reps = len(ranks[0]["time"])
    worst = {k: [max(r[k][i] for r in ranks) for i in range(reps)] for k in ("time", "naive_time", "peak", "naive_peak")}
    t_g = int(gen[1 : gen.index("p")])
    case = {
        "preset": preset, "train": train, "gen": gen, "micro_dp": ranks[0]["micro_dp"],
        "bytes_per_rank": max(max(r["bytes"]) for r in ranks),
        "naive_bytes_per_rank": max(max(r["naive_bytes"]) for r in ranks),
        "exchange_stats_bytes_per_rank": max(r["stats_bytes"] for r in ranks),
        "pushed_mb_per_rank": round(max(r["pushed_mb"] for r in ranks), 3),
        "naive_pushed_mb_per_rank": round(max(r["naive_pushed_mb"] for r in ranks), 3),
        "time_s": statistics.median(worst["time"]), "naive_time_s": statistics.median(worst["naive_time"]),
        "peak_rss_delta_mb": round(statistics.median(worst["peak"]), 2),
        "naive_peak_rss_delta_mb": round(statistics.median(worst["naive_peak"]), 2),
        "whole_params": sorted({n for r in ranks for n in r["whole"]}),
        "tokens_equal": all(r["tokens_equal"] for r in ranks),
        "max_logprob_diff": max(r["logprob_diff"] for r in ranks),
    }  # fmt: skip
    targets = {"bytes_counted_match_exchange_stats": case["bytes_per_rank"] == case["exchange_stats_bytes_per_rank"]}
    if case["micro_dp"] > 1:
        targets["bytes_le_naive_over_tg"] = case["bytes_per_rank"] <= case["naive_bytes_per_rank"] / t_g
    if train == gen:
        targets["equal_layout_zero_bytes"] = case["bytes_per_rank"] == 0
    case["targets"] = targets
    return case


def run(presets: list[str], pairs: list[str], repeats: int, build: Any, *, header: bool = True) -> dict[str, Any]:
    """Every (preset, pair) case; `build(preset)` makes the model (bench/reshard.build_model)."""
    from hfrt.roles.actor_layout import check_vllm_layout
    from hfrt.roles.training.parallel.layout import Layout, check_pair

    for pair in pairs:
        train, gen = (Layout.parse(s) for s in pair.split(":"))
        train.check(WORLD, where=f"--pairs {pair}")
        check_pair(train, gen)
        check_vllm_layout(train, gen, f"--pairs {pair}")
        if gen.tp < 2:
            raise ValueError(f"--pairs {pair}: --vllm compares pushes at a generation tp > 1")
    cases = []
    if header:
        print(HEADER, flush=True)
    for preset in presets:
        with tempfile.TemporaryDirectory(prefix="hfrt-bench-vllm-model-") as tmp:
            write_checkpoint(build(preset), Path(tmp))
            for pair in pairs:
                cases.append(summarize(preset, pair, spawn(tmp, pair, repeats)))
                if header:
                    print(_row(cases[-1]), flush=True)
    return {"bench": "reshard-vllm", "preset": presets, "world": WORLD, "backend": "gloo", "repeats": repeats,
            "vllm_cases": cases, **machine()}  # fmt: skip


HEADER = f"{'preset':>12} {'train':>7} {'gen':>7} {'m':>2} {'bytes/rank':>11} {'naive':>11} {'pushMB':>7} {'naiveMB':>7} {'time_s':>7} {'naive_s':>7} tokens_equal"


def _row(c: dict[str, Any]) -> str:
    return (f"{c['preset']:>12} {c['train']:>7} {c['gen']:>7} {c['micro_dp']:>2} {c['bytes_per_rank']:>11} "
            f"{c['naive_bytes_per_rank']:>11} {c['pushed_mb_per_rank']:>7.2f} {c['naive_pushed_mb_per_rank']:>7.2f} "
            f"{c['time_s']:>7.3f} {c['naive_time_s']:>7.3f} {c['tokens_equal']}")  # fmt: skip
