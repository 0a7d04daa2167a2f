"""Rank bodies for the tensor/pipeline-parallel tests (spawned by dist_workers.run_ranks, gloo).

Not a test module: the spawned ranks import it by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .dist_workers import make_batch


def _tiny(preset: str = "tiny") -> torch.nn.Module:
    from hfrt.roles.models import ModelConfig, load_model

    return load_model(ModelConfig(preset))


def tied_tiny() -> torch.nn.Module:
    """The tiny preset with its head tied to the embedding (SmolLM2 does this)."""
    model = _tiny()
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    return model


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits


def forward_layouts(
    rank: int, world: int, *, out_dir: Path, layouts: list[tuple[int, int]], preset: str = "tiny"
) -> dict[str, Any]:
    """forward_equal for each (tp, pp) in turn (one spawn for all: start-up dominates)."""
    return {f"t{tp}p{pp}": forward_equal(tp, pp, preset) for tp, pp in layouts}


def forward_equal(tp: int, pp: int, preset: str = "tiny") -> dict[str, Any]:
    """Logits and response log-probs of the (tp, pp) model against the full model, on every rank."""
    from hfrt.roles.training.engines.base import model_forward
    from hfrt.roles.training.engines.tp import build_mesh
    from hfrt.roles.training.parallel import tp_model

    model = _tiny(preset)
    batch = make_batch(model.config.vocab_size)
    ref_logits = _logits(model, batch)
    with torch.no_grad():
        ref_lp = model_forward(model, batch, device=torch.device("cpu"), is_value=False).log_probs
    mesh = build_mesh(tp, pp)
    tp_model.parallelize(model, tp_group=mesh.tp_group, pp_group=mesh.pp_group)
    logits = _logits(model, batch)
    with torch.no_grad():
        lp = model_forward(model, batch, device=torch.device("cpu"), is_value=False).log_probs
    pieces = {k: tuple(v.shape) for block in tp_model.local_pieces(model) for k, v in block.items()}
    # the generation side's path: an empty parallel model (never full) filled from full tensors
    empty = tp_model.empty_parallel(model.config, tp_group=mesh.tp_group, pp_group=mesh.pp_group)
    tp_model.load_full(empty, _tiny(preset).named_parameters())
    return {
        "empty_logits_diff": float((_logits(empty, batch) - ref_logits).abs().max()),
        "logits_diff": float((logits - ref_logits).abs().max()),
        "logprob_diff": float((lp - ref_lp).abs().max()),
        "pieces": pieces,
        "coords": (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank),
    }


def forward_strided() -> dict[str, Any]:
    """tp groups whose tp order is not ascending global rank (as a generation layout laid over a
    training one makes them): tp=4 ordered [0, 2, 1, 3], and tp=2 groups [2, 0] and [3, 1]."""
    import torch.distributed as dist

    from hfrt.roles.training.parallel import tp_model

    model = _tiny()
    batch = make_batch(model.config.vocab_size)
    reference = _logits(model, batch)
    rank, out = dist.get_rank(), {}
    pairs = [[2, 0], [3, 1]]
    groups = [dist.new_group(sorted(p)) for p in pairs]
    cases = {
        "t4_0213": (dist.new_group([0, 1, 2, 3]), [0, 2, 1, 3]),
        "t2_reversed": (groups[rank % 2], pairs[rank % 2]),
    }
    for key, (group, order) in cases.items():
        sharded = tp_model.empty_parallel(model.config, tp_group=group, tp_ranks=order)
        tp_model.load_full(sharded, model.named_parameters())
        out[key] = {
            "tp_rank": tp_model.layout_of(sharded).tp_rank,
            "diff": float((_logits(sharded, batch) - reference).abs().max()),
        }
    return out


def greedy_tp(tp: int) -> dict[str, Any]:
    """Greedy tokens from HFGenerationEngine over the tp-sharded tiny model and over the full one."""
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.models import load_tokenizer
    from hfrt.roles.training.engines.tp import build_mesh
    from hfrt.roles.training.parallel import tp_model

    tok = load_tokenizer("tiny")
    prompts = [tok(text)["input_ids"] for text in ("2+2=", "the cat sat", "hi")]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    def sample(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        gen = HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, share_weights=True)
        return gen.generate(prompts, params)

    reference = sample(_tiny())
    mesh = build_mesh(tp, 1)
    sharded = tp_model.build_parallel(_tiny(), tp_group=mesh.tp_group)
    out = sample(sharded)
    return {
        "tokens_equal": torch.equal(out["responses"], reference["responses"]),
        "logprob_diff": float((out["log_probs"] - reference["log_probs"]).abs().max()),
        "tokens": out["responses"].tolist(),
    }


def train_tp(tp: int, pp: int, out_dir: Path, tied: bool = False) -> dict[str, Any]:
    """One PPO step with backend "tp" (tp × pp × dp over 4 ranks) on this dp rank's rows; full weights
    after the step, this rank's pieces, and a save → step → load → step round trip."""
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    from .dist_workers import ppo_loss, rows_for

    model = tied_tiny() if tied else _tiny()
    engine: Any = build_train_engine(
        model, EngineConfig(backend="tp", tp=tp, pp=pp, micro_batch_size=2, optim=OptimConfig(lr=1e-2))
    )
    batch = rows_for(make_batch(model.config.vocab_size), engine.dp_rank, engine.dp_size)
    metrics = engine.step(ppo_loss, batch, micro_batch_size=2)
    full = engine.full_parameters()
    pieces = {k: v.clone() for block in engine.local_pieces() for k, v in block.items()}
    generation = {k: v.clone() for block in engine.state_dict_for_generation() for k, v in block.items()}
    path = engine.save(out_dir / f"ckpt_t{tp}p{pp}{'tied' if tied else ''}")
    after_save = engine.step(ppo_loss, batch, micro_batch_size=2)
    engine.load(path)
    after_load = engine.step(ppo_loss, batch, micro_batch_size=2)
    return {
        "metrics": metrics,
        "full": full if torch.distributed.get_rank() == 0 else None,
        "generation_equal": sorted(generation) == sorted(full)
        and all(torch.equal(generation[k], full[k]) for k in full),
        "pieces": {k: v for k, v in pieces.items() if "layers.0." in k or "embed" in k or "lm_head" in k},
        "coords": (engine.tp_rank, engine.pp_rank, engine.dp_rank),
        "after_save": after_save,
        "after_load": after_load,
        "ckpt_files": sorted(p.name for p in path.iterdir()),
    }


def critic_values_tp(tp: int) -> dict[str, Any]:
    """A value model (critic) sharded over tp: its values against the full model's."""
    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training.engines import EngineConfig, build_train_engine

    batch = make_batch(259)
    full = build_train_engine(load_model(ModelConfig("tiny", value_head=True)), EngineConfig(trainable=False))
    sharded = build_train_engine(
        load_model(ModelConfig("tiny", value_head=True)), EngineConfig(backend="tp", tp=tp, trainable=False)
    )
    diff = (sharded.forward_values(batch) - full.forward_values(batch)).abs().max()
    return {"values_diff": float(diff)}


#: (tp, pp) of the training checks; dp = 4 / (tp * pp)
TRAIN_LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2)]


def everything(rank: int, world: int, *, out_dir: Path, layouts: list[tuple[int, int]]) -> dict[str, Any]:
    """All the rank-side checks of test_tp_model in one spawn (process start-up dominates)."""
    return {
        "forward": {f"t{tp}p{pp}": forward_equal(tp, pp) for tp, pp in layouts},
        "greedy": greedy_tp(2),
        "strided": forward_strided(),
        "critic": critic_values_tp(4),
        "train": {f"t{tp}p{pp}": train_tp(tp, pp, out_dir) for tp, pp in TRAIN_LAYOUTS},
        "train_tied": train_tp(2, 2, out_dir, tied=True),
    }
