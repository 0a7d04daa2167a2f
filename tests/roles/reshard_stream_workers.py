"""Rank bodies for the actor's streamed, adopting transition (hybrid.ReshardHybrid built by
actor_layout._resharding_hybrid) over the real TP engine (DTensor TP with the model's plan on a
(pp, dp, tp) mesh, FSDP2 over dp), for tiny random Llama and Qwen3 configs: which generation parameters
share storage with the training pieces, how many bytes the transition added, whether the weights
are the exact slices and greedy sampling matches one process. Not a test module: spawned ranks
import it by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .reshard_workers import family_configs, full_model, pieces


def _storages(engine: Any) -> set[int]:
    from hfrt.roles.training.parallel.tp_generation import local

    return {local(p).untyped_storage().data_ptr() for p in engine.model.parameters()}


def stream_pairs(rank: int, world: int, *, out_dir: Path, pairs: list[tuple[str, str]], greedy: list[str]) -> dict[str, Any]:
    from types import SimpleNamespace

    from hfrt.daemon.base import DaemonContext
    from hfrt.roles.actor_layout import _resharding_hybrid
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.training.engines import EngineConfig, build_train_engine
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
            engine = build_train_engine(full_model(config), EngineConfig(backend="tp", tp=train.tp, pp=train.pp, trainable=False))
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
            now = {n: t.clone() for blk in engine.local_pieces() for n, t in blk.items()}  # FSDP: views of freed buffers
            before = pieces(full, train, L.train_coords(train, rank), engine.split_dims, config.num_hidden_layers)
            res["train_intact"] = all(torch.equal(now[n], t) for n, t in before.items())
            out[key] = res
    return out
