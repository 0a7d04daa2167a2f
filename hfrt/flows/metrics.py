"""A step's metrics record: reward statistics, rollout lengths and timings, stage timings,
throughput, and the reduction of per-rank metrics from a split endpoint.

No torch: plain numbers from handles' meta and inline columns. It knows metric names and how each
kind reduces over ranks; it does not know which flow made them.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from hfrt.flows.batches import non_tensor
from hfrt.flows.reward_errors import ERRORS_KEY
from hfrt.flows.timing import StageTimer
from hfrt.protocols import BatchHandle


def reward_stats(scores: list[float]) -> dict[str, float]:
    """reward/mean, max, min and accuracy (share of scores >= 1) of one step's samples."""
    return {
        "reward/mean": statistics.fmean(scores), "reward/max": max(scores), "reward/min": min(scores),
        "reward/accuracy": sum(s >= 1.0 for s in scores) / len(scores),
    }


def rollout_metrics(meta: Mapping[str, Any]) -> dict[str, float]:
    """The actor's generation timings and memory from a rollout's meta (under `rollout/`), and its
    response-length statistics."""
    out = {f"rollout/{k}": float(v) for k, v in meta.items() if k.startswith(("timing/", "memory/", "reshard/"))}
    return out | {k: float(v) for k, v in meta.items() if k.startswith("response_length/") or k == "response_tokens"}


def throughput(metrics: Mapping[str, Any], step_s: float) -> dict[str, float]:
    """perf/tokens_per_s: response tokens generated per second of the whole step."""
    tokens = float(metrics.get("response_tokens", 0.0))
    return {"perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0}


#: metric-name prefixes reduced by max over ranks: the slowest rank sets a step's time, the largest
#: footprint its memory need
MAX_OVER_RANKS = ("timing/", "memory/", "rollout/timing/", "rollout/memory/")


def reduce_rank_metrics(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """One metrics dict from the dicts a split endpoint returned, one per data-parallel rank
    (e.g. `actor.update`, `critic.update`).

    The rule by kind of metric:
    - timing/* and memory/* (also under rollout/): max over ranks — the slowest rank sets the
      step's time, the largest footprint the memory a rank needs.
    - everything else: mean over ranks. The daemons already reduce what they return over the
      group (roles/updates.py::run_updates all-reduces loss terms, grad_norm is the global norm,
      lr and optimizer_steps are the same on every rank), so every rank reports the same value
      and the mean returns it unchanged; a sum would count an already-global value (a loss, an
      optimizer-step count) once per rank.
    Every rank must report the same keys (a missing key is an error naming it and the rank).
    """
    if not per_rank:
        raise ValueError("reduce_rank_metrics: no per-rank metrics (a role group with no ranks?)")
    keys = set(per_rank[0])
    for rank, metrics in enumerate(per_rank):
        if set(metrics) != keys:
            diff = sorted(set(metrics) ^ keys)
            raise ValueError(f"reduce_rank_metrics: rank {rank} reports keys that differ from rank 0's: {diff}")
    out: dict[str, float] = {}
    for key in per_rank[0]:
        values = [float(metrics[key]) for metrics in per_rank]
        out[key] = max(values) if key.startswith(MAX_OVER_RANKS) else statistics.fmean(values)
    return out


def step_metrics(timer: StageTimer, scores: BatchHandle, rollout: BatchHandle, *parts: Mapping[str, Any]) -> dict[str, Any]:
    """A step's record: reward stats from the scores' `score` column (and `reward/errors`, the
    samples the reward function failed on and scored its error_score, with the column itself under
    ERRORS_KEY when there are any: see hfrt/flows/reward_errors.py), what each part (advantage,
    update metrics) returned, rollout lengths and timings, stage timings and throughput."""
    record: dict[str, Any] = reward_stats(non_tensor(scores, "score"))
    errors = non_tensor(scores, "score_error")
    record["reward/errors"] = float(sum(1 for message in errors if message))
    if record["reward/errors"]:
        record[ERRORS_KEY] = errors  # the Trainer takes it out: logged per kind, limited (reward_errors)
    for part in parts:
        record.update(part)
    record |= rollout_metrics(rollout.meta) | timer.timings
    step_s = timer.step_s()
    return record | {"timing/step_s": step_s} | throughput(record, step_s)
