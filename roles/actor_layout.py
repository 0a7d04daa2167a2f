"""The actor's layouts: options.parallel / options.generation.parallel → its training and generation
Layouts, the checks on them, and the hybrid engine built for the pair (a tensor-parallel generation
model filled by micro-DP resharding, vLLM at a generation tp, or a full generation copy).
Generation runs with one pipeline stage (as verl's and vLLM's rollouts do): a generation pp is
refused before launch.

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
from hfrt.roles.generation.build import generation_engine, text_decoder
from hfrt.roles.generation.grammar import Grammars
from hfrt.roles.generation.hf import HFGenerationEngine
from hfrt.roles.generation.hybrid import HybridEngine, ReshardHybrid
from hfrt.roles.training.engines import TrainEngine


def read_layouts(context: DaemonContext) -> tuple[Any, Any] | None:
    """(training, generation) Layouts from options.parallel {tp, pp} (default 1 × 1) and
    options.generation.parallel {tp} (default: the training tp; pp is always 1); None when both
    are 1 × 1 (the data-parallel actor). ValueError names the option that does not fit the world
    size or the other layout, and refuses a generation pp > 1."""
    from hfrt.roles.training.parallel.layout import Layout, check_pair

    where = f"roles.{context.role}.options"
    par = _table(context.options.get("parallel"), f"{where}.parallel")
    tp, pp = int(par.get("tp", 1)), int(par.get("pp", 1))
    gen_opts = _table(_table(context.options.get("generation"), f"{where}.generation").get("parallel"), f"{where}.generation.parallel")
    tp_g, pp_g = int(gen_opts.get("tp", tp)), int(gen_opts.get("pp", 1))
    if pp_g != 1:
        raise ValueError(
            f"{where}.generation.parallel: pp={pp_g} is not supported; generation runs at its tp with one "
            f"pipeline stage (as verl's and vLLM's rollouts do). Drop generation.parallel.pp, or raise "
            f"generation.parallel.tp to shard the generation model further"
        )
    if tp * pp == 1 and tp_g == 1:
        return None
    train = Layout.for_world(context.world_size, tp, pp, f"{where}.parallel")
    gen = Layout.for_world(context.world_size, tp_g, 1, f"{where}.generation.parallel")
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
    groups are [0, 2] and [1, 3]) are refused. vLLM then gets this rank's micro-DP pieces,
    presented full-shaped to its checkpoint-format loaders (roles/generation/vllm_pieces.py)."""
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


def build_hybrid(
    context: DaemonContext, engine: TrainEngine, tokenizer: Any, opts: ModelOptions, layouts: tuple[Any, Any] | None
) -> HybridEngine:
    """The actor's hybrid engine over `engine`. With layouts: generator 'vllm' makes each rank one
    vLLM rank at the generation tp (external_launcher), fed its micro-DP pieces; otherwise a TP/PP model at
    the generation layout filled by micro-DP resharding. Without: a full generation copy (HF or
    vLLM) the training weights are pushed into; with options.lora that copy keeps its base weights
    and only the adapters are pushed (AdapterHybrid, roles/generation/lora.py)."""
    kind = str(context.options.get("generator", "hf"))
    if opts.lora is not None and layouts is not None:
        raise ValueError(f"roles.{context.role}.options.lora: adapter sync runs without a generation layout "
                         "(options.parallel / generation.parallel); remove one of them")
    if layouts is not None and kind != "vllm":
        return _resharding_hybrid(context, engine, tokenizer, getattr(torch, opts.dtype), *layouts)
    generator = generation_engine(
        kind, model=opts.model, dtype=opts.dtype, seed=opts.seed, tokenizer=tokenizer,
        vllm=context.options.get("vllm"), layout=layouts[1] if layouts is not None else None, lora=opts.lora,
    )
    if opts.lora is not None:
        from hfrt.roles.generation.lora import AdapterHybrid

        return AdapterHybrid(engine, generator)
    if layouts is not None and layouts[1].tp > 1:
        from hfrt.roles.generation.vllm_pieces import piece_hybrid

        return piece_hybrid(context.rank, engine, generator, *layouts)
    return HybridEngine(engine, generator)


def _resharding_hybrid(
    context: DaemonContext, engine: Any, tokenizer: Any, dtype: torch.dtype, train: Any, gen: Any
) -> ReshardHybrid:
    """Generation at its own tp: a DTensor TP model (tp_generation) over this rank's generation TP
    group, filled by micro-DP resharding from the training engine's pieces (engine.full_shapes,
    engine.split_dims, engine.buckets, engine.local_pieces())."""
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel import tp_generation, tp_plan
    from hfrt.roles.training.parallel.reshard import Resharder

    config = engine.model.config
    device = torch.device(getattr(engine, "device", "cpu"))
    train = L.Layout(train.tp, train.pp, train.dp, getattr(engine, "virtual", 1))  # stages per rank: the engine's
    groups = L.new_groups(train, gen, context.rank)
    mesh = tp_generation.gen_tp_mesh(train, gen, device.type)
    override = _table(context.options.get("parallel"), "parallel").get("tp_plan")
    model = tp_generation.empty_tp_model(config, mesh["tp"], dtype=dtype, device=device, plan=override)
    params = generation_params(model, engine.full_shapes, engine.split_dims, int(tp_plan.text_config(config).num_hidden_layers))
    resharder = Resharder(train, gen, context.rank, params, groups)
    generator = HFGenerationEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, device=device,
                                   decode=text_decoder(tokenizer), grammars=Grammars(tokenizer))
    return ReshardHybrid(engine, generator, resharder)


def generation_params(model: Any, full_shapes: Mapping[str, Any], train_dims: Mapping[str, Any], num_layers: int) -> Any:
    """The reshard's Params for a generation model: the training engine's full shapes restricted
    to the generation model's parameters (a tied head comes as the embedding), its split dims
    beside the generation model's own (tp_plan.split_dims)."""
    from hfrt.roles.training.parallel import tp_plan
    from hfrt.roles.training.parallel.reshard_plan import Params

    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in full_shapes]
    if missing:
        raise ValueError(f"the training engine reports no full shape for generation parameters {missing[:5]}")
    shapes = {n: tuple(full_shapes[n]) for n in names}
    return Params(shapes, {n: train_dims.get(n) for n in names}, tp_plan.split_dims(model), num_layers)


def _table(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a table, e.g. {{tp = 2, pp = 1}}; got {value!r}")
    return dict(value)
