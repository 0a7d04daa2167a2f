"""Rank bodies for the reshard tests, for two model families (tiny random Llama and Qwen3 configs
built here, never from a hub): cut the full weights into DTensor-rule training pieces, reshard,
compare with the exact generation slices, and generate at the generation layout with a
tensor-parallel model (tp_generation) in strided generation TP groups. Not a test module: spawned
ranks import it by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def family_configs() -> dict[str, Any]:
    """llama: tied head, 3 layers (pp=2 stages of 2 and 1), vocabulary 96 (tp=4 splits it);
    qwen3: separate head, q/k norms, head_dim ≠ hidden/heads, vocabulary 90 (split at tp=2,
    whole at tp=4, whose pieces then do not nest with tp=2's)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    return {
        "llama": LlamaConfig(vocab_size=96, num_hidden_layers=3, tie_word_embeddings=True, **common),
        "qwen3": Qwen3Config(vocab_size=90, num_hidden_layers=2, head_dim=8, tie_word_embeddings=False, **common),
    }


def full_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


class Dims:
    """Each parameter's split dim at a tp size, read from a generation model sharded with the TP
    plan (tp_plan.split_dims); meshes of size 2 and 4 over the 4 ranks, built once (collective)."""

    def __init__(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        self.meshes = {
            2: DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=("x", "tp"))["tp"],
            4: DeviceMesh("cpu", torch.tensor([[0, 1, 2, 3]]), mesh_dim_names=("x", "tp"))["tp"],
        }
        self.cache: dict[tuple[str, int], dict[str, int | None]] = {}

    def at(self, family: str, config: Any, tp: int) -> dict[str, int | None]:
        from hfrt.roles.training.parallel import tp_generation, tp_plan

        if tp == 1:
            return {}
        if (family, tp) not in self.cache:
            self.cache[family, tp] = tp_plan.split_dims(tp_generation.empty_tp_model(config, self.meshes[tp]))
        return self.cache[family, tp]


def params_of(full: dict[str, torch.Tensor], config: Any, train_dims: dict, gen_dims: dict) -> Any:
    from hfrt.roles.training.parallel.reshard_plan import Params

    shapes = {n: tuple(t.shape) for n, t in full.items()}
    return Params(shapes, dict(train_dims), dict(gen_dims), int(config.num_hidden_layers))


def pieces(full: dict[str, torch.Tensor], layout: Any, c: Any, dims: dict, num_layers: int, clone: bool = False) -> dict[str, torch.Tensor]:
    """The pieces a rank at coordinates `c` holds in `layout`: its stage's parameters, each cut
    along its split dim by DTensor's chunk rule."""
    from hfrt.roles.training.parallel.stages import holds
    from hfrt.roles.training.parallel.tp_plan import chunk_bounds

    out = {}
    for n, t in full.items():
        if not holds(n, num_layers, layout.pp, c.pp, layout.vpp):
            continue
        d = dims.get(n)
        if d is not None and layout.tp > 1:
            a, b = chunk_bounds(t.shape[d], layout.tp, c.tp)
            t = t.narrow(d, a, b - a)
        out[n] = t.clone() if clone else t
    return out


def reshard_pairs(rank: int, dims: Dims, family: str, config: Any, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """For each (train, gen) pair: reshard and the naive baseline; what each rank saw."""
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.reshard import Resharder, naive_to_generation

    full = {n: p.detach() for n, p in full_model(config).named_parameters()}
    out: dict[str, Any] = {}
    for train_s, gen_s in pairs:
        train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
        groups = L.new_groups(train, gen, rank)
        params = params_of(full, config, dims.at(family, config, train.tp), dims.at(family, config, gen.tp))
        mine = pieces(full, train, L.train_coords(train, rank), params.train_dims, params.num_layers, clone=True)
        want = pieces(full, gen, L.gen_coords(train, gen, rank)[0], params.gen_dims, params.num_layers)
        r = Resharder(train, gen, rank, params, groups)
        got = r.to_generation(mine)
        naive, nstats = naive_to_generation(train, gen, rank, params, mine, groups)
        out[f"{train_s}->{gen_s}"] = {
            "names_equal": sorted(got) == sorted(want) == sorted(naive),
            "bitwise": all(torch.equal(got[n], want[n]) for n in want),
            "naive_bitwise": all(torch.equal(naive[n], want[n]) for n in want),
            "shared": sum(got[n].untyped_storage().data_ptr() == mine[n].untyped_storage().data_ptr() for n in got if n in mine),
            "n_gen": len(want),
            "own_in_gen_bytes": _own_in_gen(mine, want, r),
            "gen_bytes": sum(t.numel() * t.element_size() for t in want.values()),
            "sent": r.last.bytes_sent,
            "received": r.last.bytes_received,
            "naive_received": nstats.bytes_received,
            "naive_sent": nstats.bytes_sent,
            "fallback": sorted(r.fallback),
        }
        r.to_train()
        assert r.pieces == {}
    return out


def _own_in_gen(mine: dict[str, torch.Tensor], want: dict[str, torch.Tensor], r: Any) -> int:
    """Bytes of this rank's training rows that lie inside its generation pieces."""
    total = 0
    for name, t in mine.items():
        if name not in want:
            continue
        held = r.held(name)
        g = r.plan.want[name] if name in r.plan.want else r.fallback_plan.want[name]
        rows = max(0, min(held[1], g[1]) - max(held[0], g[0]))
        total += t.numel() // t.shape[r.params.axis(name)] * rows * t.element_size()
    return total


def generate_after_reshard(rank: int, dims: Dims, family: str, config: Any, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Greedy tokens from a TP model at the generation layout (tp_generation, in its possibly
    strided generation TP group) filled with the resharded pieces, against one full model."""
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel import tp_generation
    from hfrt.roles.training.parallel.reshard import Resharder

    reference_model = full_model(config)
    full = {n: p.detach() for n, p in reference_model.named_parameters()}
    prompts = [[5, 9, 13, 2], [7, 3], [11, 12, 40]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)

    def sample(model: torch.nn.Module) -> torch.Tensor:
        return HFGenerationEngine(model, pad_token_id=0, eos_token_id=None, share_weights=True).generate(prompts, params)["responses"]

    reference = sample(reference_model)
    out: dict[str, Any] = {}
    for train_s, gen_s in pairs:
        train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
        groups = L.new_groups(train, gen, rank)
        spec = params_of(full, config, dims.at(family, config, train.tp), dims.at(family, config, gen.tp))
        r = Resharder(train, gen, rank, spec, groups)
        got = r.to_generation(pieces(full, train, L.train_coords(train, rank), spec.train_dims, spec.num_layers))
        model = tp_generation.empty_tp_model(config, tp_generation.gen_tp_mesh(train, gen)["tp"])
        tp_generation.load_local(model, got)
        out[f"{train_s}->{gen_s}"] = torch.equal(sample(model), reference)
    return out


def everything(
    rank: int, world: int, *, out_dir: Path, pairs: list[tuple[str, str]], gen_pairs: list[tuple[str, str]], uneven: list[tuple[str, str]]
) -> dict[str, Any]:
    """All bodies, both families, in one spawn (the processes' start-up dominates the test's time).
    `uneven` pairs run on qwen3 only (its vocabulary of 90 does not split over tp=4)."""
    torch.set_num_threads(1)
    dims = Dims()
    out: dict[str, Any] = {}
    for family, config in family_configs().items():
        out[family] = {
            "reshard": reshard_pairs(rank, dims, family, config, pairs + (uneven if family == "qwen3" else [])),
            "generate": generate_after_reshard(rank, dims, family, config, gen_pairs),
        }
    return out
