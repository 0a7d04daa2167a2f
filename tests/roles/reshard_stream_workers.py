"""Rank bodies for the actor's streamed, adopting transition (hybrid.ReshardHybrid built by
actor_layout._resharding_hybrid) over a training engine that meets the TPEngine contract
(`ContractEngine`: DTensor TP with the model's plan on a (pp, dp, tp) mesh, full_shapes, buckets,
split_dims, local_pieces), for tiny random Llama and Qwen3 configs: which generation parameters
share storage with the training pieces, how many bytes the transition added, whether the weights
are the exact slices and greedy sampling matches one process. Not a test module: spawned ranks
import it by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .reshard_workers import family_configs, full_model, pieces


class ContractEngine:
    """The training side of the hybrid engine as roles/training/engines/tp.py exposes it: the full
    model sharded in place with tp_plan.apply_tp over the tp dimension of a (pp, dp, tp) mesh;
    local_pieces yields, per bucket, this stage's local pieces (a tied head on the last stage as
    lm_head.weight); with dp > 1 they are fresh copies, as FSDP's dp-gathered buffers are."""

    def __init__(self, model: torch.nn.Module, train: Any, rank: int) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        from hfrt.roles.models import transformer_blocks
        from hfrt.roles.training.engines.base import named_buckets
        from hfrt.roles.training.parallel import layout as L
        from hfrt.roles.training.parallel import tp_plan

        self.model, self.device, self.train = model, torch.device("cpu"), train
        self.full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.buckets = [names for _, names in named_buckets(model, transformer_blocks(model))]
        mesh = torch.arange(train.world).reshape(train.pp, train.dp, train.tp)
        mesh = DeviceMesh("cpu", mesh, mesh_dim_names=("pp", "dp", "tp"))
        if train.tp > 1:
            tp_plan.apply_tp(model, mesh["tp"], tp_plan.resolve_plan(model, train.tp))
        self.split_dims = tp_plan.split_dims(model)
        self.coords = L.train_coords(train, rank)
        self.sharded = train.dp > 1

    def local_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        from hfrt.roles.training.parallel.stages import holds, is_input_embedding
        from hfrt.roles.training.parallel.tp_generation import local

        layers, pp, stage = int(self.model.config.num_hidden_layers), self.train.pp, self.coords.pp
        params = {n: local(p).detach() for n, p in self.model.named_parameters(remove_duplicate=False)}
        tied = bool(self.model.config.tie_word_embeddings)
        for names in self.buckets:
            block = {n: params[n] for n in names if holds(n, layers, pp, stage)}
            if tied and pp > 1 and stage == pp - 1 and any(is_input_embedding(n) for n in names):
                block["lm_head.weight"] = params["lm_head.weight"]
            if self.sharded:
                block = {n: t.clone() for n, t in block.items()}
            if block:
                yield block


def _storages(engine: ContractEngine) -> set[int]:
    from hfrt.roles.training.parallel.tp_generation import local

    return {local(p).untyped_storage().data_ptr() for p in engine.model.parameters()}


def stream_pairs(rank: int, world: int, *, out_dir: Path, pairs: list[tuple[str, str]], greedy: list[str]) -> dict[str, Any]:
    from types import SimpleNamespace

    from hfrt.daemon.base import DaemonContext
    from hfrt.roles.actor_layout import _resharding_hybrid
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.training.parallel import layout as L

    torch.set_num_threads(1)
    prompts = [[5, 9, 13, 2], [7, 3], [11, 12, 40]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    context = DaemonContext("actor", rank, world, options={})
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    out: dict[str, Any] = {}
    for family, config in family_configs().items():
        for train_s, gen_s in pairs:
            key = f"{family}:{train_s}->{gen_s}"
            train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
            reference = full_model(config)
            full = {n: p.detach().clone() for n, p in reference.named_parameters()}
            engine = ContractEngine(full_model(config), train, rank)
            hybrid = _resharding_hybrid(context, engine, tok, torch.float32, train, gen)
            hybrid.gen.sleep()
            metrics = hybrid.to_generate()
            got = hybrid.gen.local_parameters()
            want = pieces(full, gen, L.gen_coords(train, gen, rank)[0], hybrid.resharder.params.gen_dims, config.num_hidden_layers)
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
            if f"{train_s}->{gen_s}" in greedy:
                ref = HFGenerationEngine(reference, pad_token_id=0, eos_token_id=None, share_weights=True)
                res["greedy_equal"] = torch.equal(hybrid.gen.generate(prompts, params)["responses"], ref.generate(prompts, params)["responses"])
            hybrid.to_train()
            res["freed"] = all(p.numel() == 0 for p in hybrid.gen.local_parameters().values())
            now = {n: t for blk in engine.local_pieces() for n, t in blk.items()}
            before = pieces(full, train, L.train_coords(train, rank), engine.split_dims, config.num_hidden_layers)
            res["train_intact"] = all(torch.equal(now[n], t) for n, t in before.items())
            out[key] = res
    return out
