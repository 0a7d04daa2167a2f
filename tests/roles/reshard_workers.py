"""Rank bodies for the reshard tests: cut the tiny preset into training pieces, reshard, compare
with exact slices of the full weights. Not a test module: spawned ranks import it by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _setup() -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]], Any]:
    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training.parallel.shard import ModelShape

    model = load_model(ModelConfig("tiny"))
    full = {n: p.detach() for n, p in model.named_parameters()}
    return full, {n: tuple(t.shape) for n, t in full.items()}, ModelShape.of(model.config)


def train_pieces(full: dict[str, torch.Tensor], train: Any, rank: int, shape: Any) -> dict[str, torch.Tensor]:
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.shard import holds, tp_piece

    c = L.train_coords(train, rank)
    return {
        n: tp_piece(n, tuple(t.shape), train.tp, c.tp, shape).take(t).clone()
        for n, t in full.items()
        if holds(n, shape, train.pp, c.pp)
    }


def expected_pieces(full: dict[str, torch.Tensor], train: Any, gen: Any, rank: int, shape: Any) -> dict[str, torch.Tensor]:
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.shard import holds, tp_piece

    g, _ = L.gen_coords(train, gen, rank)
    return {
        n: tp_piece(n, tuple(t.shape), gen.tp, g.tp, shape).take(t)
        for n, t in full.items()
        if holds(n, shape, gen.pp, g.pp)
    }


def reshard_pairs(rank: int, world: int, *, out_dir: Path, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """For each (train, gen) pair: reshard and the naive baseline; what each rank saw."""
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.reshard import Resharder, naive_to_generation

    full, shapes, shape = _setup()
    out: dict[str, Any] = {}
    for train_s, gen_s in pairs:
        train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
        groups = L.new_groups(train, gen, rank)
        pieces = train_pieces(full, train, rank, shape)
        want = expected_pieces(full, train, gen, rank, shape)
        r = Resharder(train, gen, rank, shapes, shape, groups)
        got = r.to_generation(pieces)
        naive, nstats = naive_to_generation(train, gen, rank, shapes, shape, pieces, groups)
        out[f"{train_s}->{gen_s}"] = {
            "names_equal": sorted(got) == sorted(want) == sorted(naive),
            "bitwise": all(torch.equal(got[n], want[n]) for n in want),
            "naive_bitwise": all(torch.equal(naive[n], want[n]) for n in want),
            "shared": sum(got[n].untyped_storage().data_ptr() == pieces[n].untyped_storage().data_ptr() for n in got if n in pieces),
            "n_gen": len(want),
            "own_bytes": sum(t.numel() * t.element_size() for t in pieces.values()),
            "own_in_gen_bytes": _own_in_gen(pieces, want, r),
            "gen_bytes": sum(t.numel() * t.element_size() for t in want.values()),
            "sent": r.last.bytes_sent,
            "received": r.last.bytes_received,
            "naive_received": nstats.bytes_received,
            "naive_sent": nstats.bytes_sent,
        }
        r.to_train()
        assert r.pieces == {}
    return out


def _own_in_gen(pieces: dict[str, torch.Tensor], want: dict[str, torch.Tensor], r: Any) -> int:
    """Bytes of this rank's training rows that lie inside its generation pieces."""
    from hfrt.roles.training.parallel.reshard_plan import split_dim

    total = 0
    for name, t in pieces.items():
        if name not in want:
            continue
        mine = r.held(name)
        g = r.plan.want[name]
        rows = max(0, min(mine[1], g[1]) - max(mine[0], g[0]))
        total += t.numel() // t.shape[split_dim(name)] * rows * t.element_size()
    return total


def generate_after_reshard(rank: int, world: int, *, out_dir: Path, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Greedy tokens from a TP model built at the generation layout (in its generation TP group)
    and loaded with the resharded pieces, against the single-process full model."""
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel import tp_model
    from hfrt.roles.training.parallel.reshard import Resharder

    full, shapes, shape = _setup()
    config = load_model(ModelConfig("tiny")).config
    tok = load_tokenizer("tiny")
    prompts = [tok(text)["input_ids"] for text in ("2+2=", "the cat sat", "hi")]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    def sample(model: torch.nn.Module) -> torch.Tensor:
        gen = HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, share_weights=True)
        return gen.generate(prompts, params)["responses"]

    reference = sample(load_model(ModelConfig("tiny")))
    out: dict[str, Any] = {}
    for train_s, gen_s in pairs:
        train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
        groups = L.new_groups(train, gen, rank)
        r = Resharder(train, gen, rank, shapes, shape, groups)
        pieces = r.to_generation(train_pieces(full, train, rank, shape))
        model = tp_model.empty_parallel(config, tp_group=groups.gen_tp if gen.tp > 1 else None)
        tp_model.load_pieces(model, pieces.items())
        out[f"{train_s}->{gen_s}"] = torch.equal(sample(model), reference)
    return out


def uneven_shapes() -> tuple[dict[str, tuple[int, ...]], Any]:
    """A Llama-shaped parameter set with a 10-row vocabulary: 3+3+2+2 over tp=4 but 5+5 over tp=2."""
    from hfrt.roles.training.parallel.shard import ModelShape

    shape = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2, vocab_size=10)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (10, 8)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (8, 8), p + "self_attn.k_proj.weight": (4, 8),
                   p + "self_attn.o_proj.weight": (8, 8), p + "mlp.down_proj.weight": (8, 16),
                   p + "input_layernorm.weight": (8,)}  # fmt: skip
    return shapes | {"model.norm.weight": (8,), "lm_head.weight": (10, 8)}, shape


def uneven_pairs(rank: int, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Reshard random weights of the uneven shapes; the pieces against exact slices, and which
    parameters took the fallback over the training model-parallel group."""
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.reshard import Resharder

    shapes, shape = uneven_shapes()
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    out: dict[str, Any] = {}
    for train_s, gen_s in pairs:
        train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
        groups = L.new_groups(train, gen, rank)
        r = Resharder(train, gen, rank, shapes, shape, groups)
        got = r.to_generation(train_pieces(full, train, rank, shape))
        want = expected_pieces(full, train, gen, rank, shape)
        out[f"{train_s}->{gen_s}"] = {
            "bitwise": sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want),
            "fallback": sorted(r.fallback),
        }
    return out


def everything(
    rank: int,
    world: int,
    *,
    out_dir: Path,
    pairs: list[tuple[str, str]],
    gen_pairs: list[tuple[str, str]],
    uneven: list[tuple[str, str]],
) -> dict[str, Any]:
    """All bodies in one spawn (the processes' start-up dominates the test's time)."""
    return {
        "reshard": reshard_pairs(rank, world, out_dir=out_dir, pairs=pairs),
        "generate": generate_after_reshard(rank, world, out_dir=out_dir, pairs=gen_pairs),
        "uneven": uneven_pairs(rank, uneven),
    }
