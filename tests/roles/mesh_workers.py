"""Rank bodies for test_mesh_engine: one PPO update of each model family at a tp × pp × dp layout
through the TPEngine (DTensor TP, pipelining, FSDP2), and DCP checkpoints moved across layouts.

Not a test module: the spawned ranks import it by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import model_zoo
from .dist_workers import make_batch, ppo_loss, rows_for


def _engine(
    family: str, tp: int, pp: int, *, seed: int = 0, tied: bool = False, schedule: str = "1f1b", value: bool = False
) -> Any:
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    model = model_zoo.value_model(family, seed=seed) if value else model_zoo.model(family, seed=seed, tied=tied)
    config = EngineConfig(backend="tp", tp=tp, pp=pp, micro_batch_size=2, pp_schedule=schedule, optim=OptimConfig(lr=1e-2, eps=1e-3))
    return build_train_engine(model, config)


def one_update(family: str, tp: int, pp: int, tied: bool = False, schedule: str = "1f1b") -> dict[str, Any]:
    """Log-probs (a critic's values) before, then one PPO (value) step on this dp rank's rows: loss,
    grad norm, full gradients and full weights after (rank 0 keeps the tensors). family
    "critic-<f>" is f's decoder stack with a value head."""
    value = family.startswith("critic-")
    engine = _engine(family.removeprefix("critic-"), tp, pp, tied=tied, schedule=schedule, value=value)
    batch = rows_for(make_batch(128), engine.dp_rank, engine.dp_size)
    log_probs = engine.forward_values(batch) if value else engine.forward_logprobs(batch)
    metrics = engine.step(model_zoo.value_loss_fn if value else ppo_loss, batch, micro_batch_size=2)
    # A gradient split over dp and tp at once is not gathered here (two DTensor all-gathers per
    # tensor); at those layouts the gradient norm and the weights after the step carry the check.
    both = engine.tp_size > 1 and engine.dp_size > 1
    grads, weights = (None if both else engine.full_gradients()), engine.full_parameters()
    keep = dist.get_rank() == 0
    _retire(engine)
    return {
        "coords": (engine.tp_rank, engine.pp_rank, engine.dp_rank),
        "log_probs": log_probs,
        "metrics": metrics,
        "grads": grads if keep else None,
        "weights": weights if keep else None,
    }


def _retire(engine: Any) -> None:
    """Drop an engine on every rank together (its groups go with it) before the next case starts."""
    import gc

    dist.barrier()
    del engine
    gc.collect()
    dist.barrier()


def zoo(rank: int, world: int, *, out_dir: Path, cases: list[tuple[str, int, int, bool]]) -> dict[str, Any]:
    import sys

    out = {}
    for f, tp, pp, tied in cases:
        name = f"{f}-t{tp}p{pp}{'-tied' if tied else ''}"
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)  # names the case a crash happened in
        out[name] = one_update(f, tp, pp, tied)
    return out


def across_layouts(rank: int, world: int, *, out_dir: Path, family: str, layouts: list[tuple[int, int]]) -> dict[str, Any]:
    """Train a step at the first layout and save; at each next layout, load into a differently
    initialised model (weights must equal the saved ones), step, save. Also the uninterrupted run
    at the first layout, for comparison: every step's loss and the final weights."""
    batch_all = make_batch(128)
    ref = _engine(family, *layouts[0])
    ref_losses = []
    for _ in layouts:
        ref_losses.append(ref.step(ppo_loss, rows_for(batch_all, ref.dp_rank, ref.dp_size), micro_batch_size=2)["loss"])
    ref_weights = ref.full_parameters()
    losses, loaded_equal, folder = [], [], None
    for index, (tp, pp) in enumerate(layouts):
        engine = _engine(family, tp, pp, seed=index)  # a different init: the checkpoint must overwrite it
        if folder is not None:
            before = saved
            engine.load(folder)
            after = engine.full_parameters()
            loaded_equal.append(max(float((after[k] - before[k]).abs().max()) for k in before))
        batch = rows_for(batch_all, engine.dp_rank, engine.dp_size)
        losses.append(engine.step(ppo_loss, batch, micro_batch_size=2)["loss"])
        folder = engine.save(out_dir / f"ckpt-{index}")
        saved = engine.full_parameters()
    keep = dist.get_rank() == 0
    final_diff = max(float((saved[k] - ref_weights[k]).abs().max()) for k in saved)
    return {"losses": losses, "ref_losses": ref_losses, "loaded_diff": loaded_equal, "final_diff": final_diff,
            "files": sorted(p.name for p in Path(folder).iterdir()) if keep and folder else []}  # fmt: skip
