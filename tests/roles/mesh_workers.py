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
    family: str, tp: int, pp: int, *, seed: int = 0, tied: bool = False, schedule: str = "1f1b", value: bool = False,
    loss_parallel: bool = False, precision: str = "fp32", sequence_parallel: bool = False,
) -> Any:  # fmt: skip
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    model = model_zoo.value_model(family, seed=seed) if value else model_zoo.model(family, seed=seed, tied=tied)
    config = EngineConfig(backend="tp", tp=tp, pp=pp, micro_batch_size=2, pp_schedule=schedule, loss_parallel=loss_parallel,
                          mixed_precision=precision, sequence_parallel=sequence_parallel,
                          optim=OptimConfig(lr=1e-2, eps=1e-3))  # fmt: skip
    return build_train_engine(model, config)


def _gathers(run: Any) -> tuple[Any, int]:
    """run()'s result and how many functional all-gathers (DTensor's) it dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = str(func)  # _c10d_functional.all_gather_into_tensor (not FSDP's fsdp.all_gather_copy_in / c10d ops)
            self.n += "_c10d_functional" in name and "all_gather" in name
            return func(*args, **(kwargs or {}))

    with Count() as count:
        out = run()
    return out, count.n


def one_update(
    family: str, tp: int, pp: int, tied: bool = False, schedule: str = "1f1b", extra: str = ""
) -> dict[str, Any]:
    """Log-probs (a critic's values), entropy and Σπ² before, then one PPO (value) step on this dp
    rank's rows: loss, grad norm, full gradients and full weights after (rank 0 keeps the tensors).
    family "critic-<f>" is f's decoder stack with a value head; extra "lp": loss_parallel (the
    forward's DTensor all-gathers are counted), "bf16": bf16 compute (pipeline shapes inferred),
    "sp": sequence parallelism."""
    value = family.startswith("critic-")
    engine = _engine(family.removeprefix("critic-"), tp, pp, tied=tied, schedule=schedule, value=value,
                     loss_parallel=extra == "lp", precision="bf16" if extra == "bf16" else "fp32",
                     sequence_parallel=extra == "sp")  # fmt: skip
    batch = rows_for(make_batch(128), engine.dp_rank, engine.dp_size)
    entropy, sum_pi_squared, gathers = None, None, 0
    if value:
        log_probs = engine.forward_values(batch)
    else:
        log_probs, gathers = _gathers(lambda: engine.forward_logprobs(batch))
        both = engine.forward(batch, with_entropy=True, with_sum_pi_squared=True)
        entropy, sum_pi_squared = both.entropy, both.sum_pi_squared
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
        "entropy": entropy,
        "sum_pi_squared": sum_pi_squared,
        "gathers": gathers,
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


def case_name(family: str, tp: int, pp: int, tied: bool = False, schedule: str = "1f1b", extra: str = "") -> str:
    """A model-zoo case's name, e.g. llama-t2p2-tied, qwen3-t1p2-interleaved-1f1b, qwen3-t2p2-lp."""
    return f"{family}-t{tp}p{pp}{'-tied' if tied else ''}{'' if schedule == '1f1b' else '-' + schedule}{'-' + extra if extra else ''}"


def zoo(
    rank: int, world: int, *, out_dir: Path, cases: list[tuple[Any, ...]], reshard: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """Every case (family, tp, pp, tied[, schedule[, extra]]) in turn, by case_name; then, in the same
    processes, the `reshard` pairs of reshard_interleaved (under "reshard")."""
    import sys

    out: dict[str, Any] = {}
    for case in cases:
        name = case_name(*case)
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)  # names the case a crash happened in
        out[name] = one_update(*case)
    if reshard:
        print(f"rank {rank}: reshard {reshard}", file=sys.stderr, flush=True)
        out["reshard"] = reshard_interleaved(rank, world, out_dir=out_dir, pairs=reshard)
    return out


def across_layouts(rank: int, world: int, *, out_dir: Path, family: str, layouts: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Train a step at the first layout and save; at each next layout, load into a differently
    initialised model (weights must equal the saved ones), step, save. Also the uninterrupted run
    at the first layout, for comparison: every step's loss and the final weights. A layout is
    (tp, pp[, schedule])."""
    batch_all = make_batch(128)
    ref = _engine(family, *layouts[0][:2])
    ref_losses = []
    for _ in layouts:
        ref_losses.append(ref.step(ppo_loss, rows_for(batch_all, ref.dp_rank, ref.dp_size), micro_batch_size=2)["loss"])
    ref_weights = ref.full_parameters()
    losses, loaded_equal, folder = [], [], None
    saved: dict[str, torch.Tensor] = {}  # the weights the last layout saved
    for index, (tp, pp, *schedule) in enumerate(layouts):
        # a different init: the checkpoint must overwrite it
        engine = _engine(family, tp, pp, seed=index, schedule=schedule[0] if schedule else "1f1b")
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


def reshard_interleaved(rank: int, world: int, *, out_dir: Path, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """The actor's transition from an interleaved training layout ('t1p2d2v2': 2 stages per pipeline
    rank) to a generation layout over the real engine: this rank's training pieces are the stage
    rule's (stages.holds with vpp), and the generation pieces are bitwise the full weights' slices."""
    from types import SimpleNamespace

    from hfrt.daemon.base import DaemonContext
    from hfrt.roles.actor_layout import _resharding_hybrid
    from hfrt.roles.training.engines import EngineConfig, build_train_engine
    from hfrt.roles.training.parallel import layout as L

    from .reshard_workers import pieces

    context = DaemonContext("actor", rank, world, options={})
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    out: dict[str, Any] = {}
    for train_s, gen_s in pairs:
        train, gen = L.Layout.parse(train_s), L.Layout.parse(gen_s)
        full = {n: p.detach().clone() for n, p in model_zoo.model("llama").named_parameters()}
        layers = model_zoo.config("llama").num_hidden_layers
        config = EngineConfig(backend="tp", tp=train.tp, pp=train.pp, pp_schedule="interleaved-1f1b",
                              pp_stages_per_rank=train.vpp, trainable=False)  # fmt: skip
        engine = build_train_engine(model_zoo.model("llama"), config)
        held = {n: t.clone() for block in engine.local_pieces() for n, t in block.items()}
        expected = pieces(full, train, L.train_coords(train, rank), engine.split_dims, layers)
        # the layout as the actor's options give it (no vpp): the engine's stages per rank apply
        hybrid = _resharding_hybrid(context, engine, tok, torch.float32, L.Layout(train.tp, train.pp, train.dp), gen)
        hybrid.gen.sleep()
        metrics = hybrid.to_generate()
        got = hybrid.gen.local_parameters()
        want = pieces(full, gen, L.gen_coords(train, gen, rank)[0], hybrid.resharder.params.gen_dims, layers)
        out[f"{train_s}->{gen_s}"] = {
            "train_names": sorted(held) == sorted(expected),
            "train_equal": all(torch.equal(held[n], t) for n, t in expected.items() if n in held),
            "gen_names": sorted(got) == sorted(want),
            "gen_equal": all(torch.equal(got[n], t) for n, t in want.items() if n in got),
            "bytes_received": metrics["reshard/bytes_received"],
        }
        hybrid.to_train()
        _retire(engine)
    return out
