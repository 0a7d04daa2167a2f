"""Rank bodies for the tensor/pipeline-parallel tests (spawned by dist_workers.run_ranks, gloo).

Not a test module: the spawned ranks import it by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .dist_workers import make_batch


def _tiny() -> torch.nn.Module:
    from hfrt.roles.models import ModelConfig, load_model

    return load_model(ModelConfig("tiny"))


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits


def forward_layouts(rank: int, world: int, *, out_dir: Path, layouts: list[tuple[int, int]]) -> dict[str, Any]:
    """forward_equal for each (tp, pp) in turn (one spawn for all: start-up dominates)."""
    return {f"t{tp}p{pp}": forward_equal(tp, pp) for tp, pp in layouts}


def forward_equal(tp: int, pp: int) -> dict[str, Any]:
    """Logits and response log-probs of the (tp, pp) model against the full model, on every rank."""
    from hfrt.roles.engines.base import model_forward
    from hfrt.roles.engines.tp import build_mesh
    from hfrt.roles.parallel import tp_model

    model = _tiny()
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
    return {
        "logits_diff": float((logits - ref_logits).abs().max()),
        "logprob_diff": float((lp - ref_lp).abs().max()),
        "pieces": pieces,
        "coords": (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank),
    }
