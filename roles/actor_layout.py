"""The actor's layouts: options.parallel / options.generation.parallel → its training and generation
Layouts, the checks on them, and the hybrid engine built for the pair (a TP/PP generation model
filled by micro-DP resharding, vLLM at a generation tp, or a full generation copy).

The training layout comes from the options alone: placement (hfrt.deploy.placement) writes a
cluster spec's tp_size / pp_size into options.parallel, under what the user set there. It knows
options, layouts and engine constructors; nothing of endpoints, losses or the algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hfrt.daemon.base import DaemonContext
from hfrt.roles.common import ModelOptions
from hfrt.roles.generation.build import generation_engine
from hfrt.roles.generation.hf import HFGenerationEngine
from hfrt.roles.generation.hybrid import HybridEngine, ReshardHybrid
from hfrt.roles.training.engines import TrainEngine


def read_layouts(context: DaemonContext) -> tuple[Any, Any] | None:
    """(training, generation) Layouts from options.parallel {tp, pp} (default 1 × 1) and
    options.generation.parallel {tp, pp} (default: the training sizes); None when both are 1 × 1
    (the data-parallel actor). ValueError names the option that does not fit the world size or
    the other layout."""
    from hfrt.roles.training.parallel.layout import Layout, check_pair

    where = f"roles.{context.role}.options"
    par = _table(context.options.get("parallel"), f"{where}.parallel")
    tp, pp = int(par.get("tp", 1)), int(par.get("pp", 1))
    gen_opts = _table(_table(context.options.get("generation"), f"{where}.generation").get("parallel"), f"{where}.generation.parallel")
    tp_g, pp_g = int(gen_opts.get("tp", tp)), int(gen_opts.get("pp", pp))
    if tp * pp == 1 and tp_g * pp_g == 1:
        return None
    train = Layout.for_world(context.world_size, tp, pp, f"{where}.parallel")
    gen = Layout.for_world(context.world_size, tp_g, pp_g, f"{where}.generation.parallel")
    check_pair(train, gen)
    return train, gen


def with_layout(options: Mapping[str, Any], layouts: tuple[Any, Any] | None) -> dict[str, Any]:
    """options with engine.tp / engine.pp from the training layout (backend 'tp' unless fsdp2)."""
    out = dict(options)
    if layouts is None:
        return out
    train = layouts[0]
    engine = dict(out.get("engine") or {})
    if engine.get("backend", "local") not in ("tp", "fsdp2"):
        engine["backend"] = "tp"
    engine.update(tp=train.tp, pp=train.pp)
    out["engine"] = engine
    return out


def check_vllm_layout(train: Any, gen: Any, where: str) -> None:
    """generator 'vllm' at a generation layout (tensor parallel only: hfrt does not run vLLM's
    pipeline stages, refused here). vLLM's external_launcher orders its ranks TP
    innermost over the whole world (TP rank = rank % tp, DP rank = rank // tp), so the generation
    TP groups must be sets of consecutive ranks; strided groups (e.g. t4p1d1 → t2p1d2, whose
    groups are [0, 2] and [1, 3]) are refused. vLLM gets full checkpoint tensors one block at a
    time and keeps its TP slice itself: its loaders narrow full tensors
    (model_executor/layers/linear.py weight_loader) into fused per-rank qkv_proj / gate_up_proj and
    a vocabulary padded to a multiple of 64 (VocabParallelEmbedding), which hfrt's micro-DP pieces
    do not match, so the transition moves each block whole (not micro-DP resharding)."""
    from hfrt.roles.training.parallel.layout import gen_coords

    if gen.pp > 1:
        raise ValueError(f"{where}: pp={gen.pp} with generator 'vllm' is not built (vLLM runs at a generation tp only); use generator 'hf'")
    for rank in range(train.world):
        g, _ = gen_coords(train, gen, rank)
        if g.dp != rank // gen.tp:  # the tp order within a group is vLLM's own (full tensors come in)
            raise ValueError(
                f"{where}: {train} → {gen} puts rank {rank} in generation dp group {g.dp}; vLLM's "
                f"external_launcher puts it in {rank // gen.tp} (TP groups of consecutive ranks). "
                f"Use generator 'hf' for this layout pair"
            )


def gen_pp_group(train: Any, gen: Any, rank: int) -> tuple[Any, list[int] | None]:
    """This rank's generation pipeline group and its ranks in stage order, (None, None) when the
    generation layout has one stage. Collective when pp_g > 1: every rank creates every group."""
    if gen.pp == 1:
        return None, None
    import torch.distributed as dist

    from hfrt.roles.training.parallel.layout import gen_pp_groups

    mine: tuple[Any, list[int] | None] = (None, None)
    for ranks in gen_pp_groups(train, gen):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = (group, ranks)
    return mine


def build_hybrid(
    context: DaemonContext, engine: TrainEngine, tokenizer: Any, opts: ModelOptions, layouts: tuple[Any, Any] | None
) -> HybridEngine:
    """The actor's hybrid engine over `engine`. With layouts: generator 'vllm' makes each rank one
    vLLM rank at the generation tp (external_launcher), fed full blocks; otherwise a TP/PP model at
    the generation layout filled by micro-DP resharding. Without: a full generation copy (HF or
    vLLM) the training weights are pushed into."""
    kind = str(context.options.get("generator", "hf"))
    if layouts is not None and kind != "vllm":
        return _resharding_hybrid(context, engine, tokenizer, getattr(torch, opts.dtype), *layouts)
    generator = generation_engine(
        kind, model=opts.model, dtype=opts.dtype, seed=opts.seed, tokenizer=tokenizer,
        vllm=context.options.get("vllm"), layout=layouts[1] if layouts is not None else None,
    )
    return HybridEngine(engine, generator)


def _resharding_hybrid(
    context: DaemonContext, engine: Any, tokenizer: Any, dtype: torch.dtype, train: Any, gen: Any
) -> ReshardHybrid:
    """Generation at its own layout: a TP model in this rank's generation TP group, filled by
    micro-DP resharding from the training engine's pieces (roles/training/parallel)."""
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel import tp_model
    from hfrt.roles.training.parallel.reshard import Resharder
    from hfrt.roles.training.parallel.shard import ModelShape

    config = engine.model.config
    groups = L.new_groups(train, gen, context.rank)
    shapes = {n: tuple(shape) for n, (shape, _) in engine.layout.full_shapes.items()}
    resharder = Resharder(train, gen, context.rank, shapes, ModelShape.of(config), groups)
    pp_group, pp_ranks = gen_pp_group(train, gen, context.rank)
    # the group's ranks in generation-tp order: a strided group need not be ascending
    model = tp_model.empty_parallel(
        config, tp_group=groups.gen_tp, tp_ranks=groups.gen_tp_ranks, pp_group=pp_group, pp_ranks=pp_ranks, dtype=dtype
    )
    generator = HFGenerationEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return ReshardHybrid(engine, generator, resharder)


def _table(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a table, e.g. {{tp = 2, pp = 1}}; got {value!r}")
    return dict(value)
