"""Engine calls the actor, critic and reference share: forward passes over equal rows per rank,
and the update loop — PPO epochs over mini-batches of the rows this rank holds, one optimizer
step per mini-batch, losses normalised over the whole group's batch.

The role supplies `make_loss(scale, shares)`: a LossFn for one mini-batch that reads `scale`
(global token / sequence counts of that mini-batch over all ranks, padding excluded) instead of
the engine's own, and may add loss terms to `shares` (e.g. "actor/pg_loss"); shares are summed
over micro-batches and averaged over ranks, which gives each term's value over the global
mini-batch. Because `scale` is global, how the engine cuts a mini-batch into micro-batches (rows,
a token budget, trimmed or packed: training/batching.py) leaves the loss and its gradient
unchanged. It knows nothing of which loss is computed, of models, or of the wire.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from hfrt.roles.losses import LossScale
from hfrt.roles.rows import Tensors, all_reduce, equal_rows, reduce_metrics, unpad
from hfrt.roles.training.engines import ForwardOutput, LossFn, TrainEngine
from hfrt.wire.endpoints import chunk_bounds
from hfrt.wire.loss_options import UpdateSchedule as UpdateSchedule  # declared with the loss options

#: step metrics an update reports summed over its optimizer steps and dp ranks (the rest: averaged):
#: token positions its passes ran (shared prefixes once, padding included), and its rows' real tokens
SUMMED = frozenset({"tokens_computed", "tokens_in_batch"})
#: make_loss(scale, shares) → the loss function of one mini-batch
MakeLoss = Callable[[LossScale, dict[str, float]], LossFn]


def forward_equal(engine: TrainEngine, tensors: Tensors, endpoint: str, **kwargs: Any) -> ForwardOutput:
    """engine.forward over this rank's rows, padded to the group's row count first (collective
    with a process group) and cut back after; outputs on CPU, [rows, R]."""
    padded, pad = equal_rows(tensors, endpoint)
    out = engine.forward(padded, **kwargs)
    parts = (out.log_probs, out.entropy, out.values, out.sum_pi_squared, out.top1)
    return ForwardOutput(*(None if t is None else unpad(t, pad) for t in parts))


def mini_batch_count(global_rows: float, mini_batch_size: int, local_rows: int) -> int:
    if mini_batch_size <= 0:
        return 1
    return max(1, min(local_rows, math.ceil(global_rows / mini_batch_size)))


def require_one_step(schedule: UpdateSchedule, local_rows: int, endpoint: str) -> None:
    """Refuse an update without old log-probs that would take more than one optimizer step
    (after the first step the current log-probs are no longer the rollout policy's)."""
    [global_rows] = all_reduce([local_rows])
    minis = mini_batch_count(global_rows, schedule.ppo_mini_batch_size, max(local_rows, 1))
    if schedule.ppo_epochs != 1 or minis != 1:
        raise ValueError(
            f"{endpoint}: no old_log_probs column, which is right only for one optimizer step per rollout; "
            f"this call takes ppo_epochs={schedule.ppo_epochs} x {minis} mini-batch(es): "
            "pass the old log-probs (actor.compute_log_prob) or update on-policy"
        )


def run_updates(
    engine: TrainEngine,
    tensors: Tensors,
    make_loss: MakeLoss,
    schedule: UpdateSchedule,
    *,
    prefix: str,
    endpoint: str,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_top1: bool = False,
) -> dict[str, float]:
    """Every optimizer step of one update call; metrics averaged over steps, equal on every rank."""
    start = time.perf_counter()
    padded, pad = equal_rows(tensors, endpoint)
    rows = int(padded["response_mask"].shape[0])
    real = rows - pad
    dp = engine.dp_group  # rows differ only across data-parallel ranks (tp / pp ranks share them)
    [global_rows] = all_reduce([real], group=dp)
    bounds = chunk_bounds(rows, mini_batch_count(global_rows, schedule.ppo_mini_batch_size, rows))
    totals: dict[str, float] = {}
    steps = 0
    lr = 0.0
    for _ in range(schedule.ppo_epochs):
        for lo, hi in bounds:
            mini = {k: v[lo:hi] for k, v in padded.items()}
            tokens, seqs = all_reduce(counts(mini["response_mask"]), group=dp)
            scale = LossScale(max(tokens, 1.0), max(seqs, 1.0), engine.dp_size)
            shares: dict[str, float] = {}
            metrics = engine.step(
                make_loss(scale, shares), mini, schedule.micro_batch_size,
                temperature=temperature, with_entropy=with_entropy, with_top1=with_top1,
            )
            shares = engine.from_last_stage(shares)  # with pipeline stages only the last computed them
            computed, in_batch = all_reduce([float(t) for t in engine.sharing.tokens], group=dp)
            if in_batch:  # the same on every rank; 0 where the engine plans no micro-batches (pipeline stages)
                metrics |= {"tokens_computed": computed, "tokens_in_batch": in_batch}
            if shares:  # same keys on every rank: every rank ran the same micro-batches
                metrics |= {k: v / engine.dp_size for k, v in reduce_metrics(shares, "sum", dp).items()}
            lr = metrics.pop("lr")
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            steps += 1
    out = {_named(prefix, k): v if k in SUMMED else v / steps for k, v in totals.items()}
    out[f"{prefix}/lr"] = lr
    out[f"{prefix}/optimizer_steps"] = float(steps)
    out[f"timing/update_{prefix}_s"] = reduce_metrics({"t": time.perf_counter() - start}, "max")["t"]
    return out


def counts(response_mask: torch.Tensor) -> list[float]:
    """[response tokens, rows with at least one response token] of one mini-batch: rows whose
    mask is empty (equal-rows padding, or an empty response) count in neither."""
    return [float(response_mask.sum()), float((response_mask.sum(dim=-1) > 0).sum())]


def _named(prefix: str, key: str) -> str:
    return key if "/" in key else f"{prefix}/{key}"


def accumulate(shares: dict[str, float], key: str, value: Any) -> None:
    """Add one micro-batch's share of a loss term (a tensor or float) to `shares`."""
    shares[key] = shares.get(key, 0.0) + float(value)
