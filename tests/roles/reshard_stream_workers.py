"""Rank bodies for the actor's streamed, adopting transition (hybrid.ReshardHybrid over a real TP
engine): which generation parameters share storage with the training pieces, how many bytes the
transition added, and whether the weights are the exact slices. Not a test module: spawned ranks
import it by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _hybrid(engine: Any, train: Any, gen: Any, rank: int) -> Any:
    """What the actor's build_hybrid builds at a generation layout (actor_layout._resharding_hybrid), on the tiny preset."""
    from hfrt.roles.actor_layout import gen_pp_group
    from hfrt.roles.generation.hf import HFGenerationEngine
    from hfrt.roles.generation.hybrid import ReshardHybrid
    from hfrt.roles.models import load_tokenizer
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel import tp_model
    from hfrt.roles.training.parallel.reshard import Resharder
    from hfrt.roles.training.parallel.shard import ModelShape

    config = engine.model.config
    groups = L.new_groups(train, gen, rank)
    shapes = {n: tuple(s) for n, (s, _) in engine.layout.full_shapes.items()}
    resharder = Resharder(train, gen, rank, shapes, ModelShape.of(config), groups)
    pp_group, pp_ranks = gen_pp_group(train, gen, rank)
    model = tp_model.empty_parallel(config, tp_group=groups.gen_tp, tp_ranks=groups.gen_tp_ranks, pp_group=pp_group, pp_ranks=pp_ranks)
    tok = load_tokenizer("tiny")
    generator = HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    generator.sleep()
    return ReshardHybrid(engine, generator, resharder)


def _storages(engine: Any) -> set[int]:
    """Data pointers of the storages behind this rank's training parameters (local pieces)."""
    from torch.distributed.tensor import DTensor

    out = set()
    for p in engine.model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        out.add(t.untyped_storage().data_ptr())
    return out


def stream_pairs(rank: int, world: int, *, out_dir: Path, pairs: list[tuple[str, str]], greedy: list[str]) -> dict[str, Any]:
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
    from hfrt.roles.training.engines import EngineConfig, build_train_engine
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.shard import ModelShape

    from .reshard_workers import expected_pieces

    tok = load_tokenizer("tiny")
    prompts = [tok(text)["input_ids"] for text in ("2+2=", "the cat sat", "hi")]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    out: dict[str, Any] = {}
    for train_s, gen_s in pairs:
        key = f"{train_s}->{gen_s}"
        train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
        model = load_model(ModelConfig("tiny"))
        engine: Any = build_train_engine(model, EngineConfig(backend="tp", tp=train.tp, pp=train.pp, trainable=False))
        full = engine.full_parameters()
        want = expected_pieces(full, train, gen, rank, ModelShape.of(model.config))
        hybrid = _hybrid(engine, train, gen, rank)
        metrics = hybrid.to_generate()
        got = {n: p.detach() for n, p in hybrid.gen.model.named_parameters()}
        training = _storages(engine)
        storages = [t.untyped_storage() for t in got.values()]
        res: dict[str, Any] = {
            "names_equal": sorted(got) == sorted(want),
            "bitwise": all(torch.equal(got[n], want[n]) for n in want if n in got),
            "shared_with_training": sum(s.data_ptr() in training for s in storages),
            "n_gen": len(got),
            # bytes of storage the transition added (distinct storages not the training ones)
            "added_bytes": sum({s.data_ptr(): s.nbytes() for s in storages if s.data_ptr() not in training}.values()),
            "gen_bytes": sum(t.numel() * t.element_size() for t in got.values()),
            "metrics": metrics,
        }
        if key in greedy:
            reference = load_model(ModelConfig("tiny"))
            ref = HFGenerationEngine(reference, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, share_weights=True)
            res["greedy_equal"] = torch.equal(hybrid.gen.generate(prompts, params)["responses"], ref.generate(prompts, params)["responses"])
        hybrid.to_train()
        res["freed"] = all(p.numel() == 0 for p in hybrid.gen.model.parameters())
        res["train_intact"] = all(torch.equal(a, b) for a, b in zip(full.values(), engine.full_parameters().values()))
        out[key] = res
    return out
