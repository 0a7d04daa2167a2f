"""What the built-in RL flows share: their config dataclass, prompt batches made in the controller,
per-stage timing with the start-early / await-late helper, and the metrics.jsonl writer.

No torch: everything here handles futures, handles and plain numbers. It knows the flows' stages
by name only; what each stage computes is the flow's business.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from hfrt.protocols import BatchHandle
from hfrt.protocols.handles import Shard

C = TypeVar("C", bound="FlowConfig")
#: how long one call of a flow may take before the flow gives up (a step on CPU takes seconds)
CALL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class FlowConfig:
    """Settings every built-in RL flow reads (`--set key=value`).

    steps: RL steps. prompts_per_step: prompts per step (each sampled `n` times where the flow
    samples groups). seed: of the synthetic task. max_operand: the task's largest addend.
    max_new_tokens / temperature: sampling. ppo_epochs / ppo_mini_batch_size: of both updates.
    entropy_coeff: the actor's entropy bonus (keeps a small policy exploring).
    run_dir: set by `hfrt controller` (metrics.jsonl goes there); "" writes no file.
    """

    steps: int = 150
    prompts_per_step: int = 16
    seed: int = 0
    max_operand: int = 2
    max_new_tokens: int = 2
    temperature: float = 1.0
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 0
    entropy_coeff: float = 0.01
    run_dir: str = ""

    @classmethod
    def read(cls: type[C], config: Mapping[str, Any]) -> C:
        """The config from a flow's `config` dict: unknown keys and values of the wrong type are
        errors naming the key, raised before any daemon is called."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - set(fields))
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; this flow reads {sorted(fields)}")
        values: dict[str, Any] = {}
        for key, raw in config.items():
            kind = type(fields[key].default)
            if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
                raw = float(raw)
            if not isinstance(raw, kind) or (kind is not bool and isinstance(raw, bool)):
                raise ValueError(f"config {key}={raw!r}: expected {kind.__name__}")
            values[key] = raw
        return cls(**values)


def prompts_handle(columns: Mapping[str, list[Any]]) -> BatchHandle:
    """A batch of non-tensor columns made in the controller: one shard that no daemon owns, so the
    receiving ranks read their rows straight out of the handle."""
    rows = len(next(iter(columns.values())))
    return BatchHandle((Shard("controller:0", rows, {}, {k: list(v) for k, v in columns.items()}),))


def non_tensor(handle: BatchHandle, name: str) -> list[Any]:
    """A non-tensor column of a batch handle (carried inline in its shards: no bytes move)."""
    return [value for shard in handle.shards for value in shard.non_tensor.get(name, [])]


class StageTimer:
    """Wall time of each stage and call of one step, as `timing/<name>_s` metrics.

    Overlap is start early, await late: calling an endpoint sends it at once and returns a future,
    so independent calls made together run together, and `together` awaits them as one stage::

        values, ref, scores = await timer.together(
            "stage2", values=critic.compute_values(rollout),
            ref_log_prob=reference.compute_log_prob(rollout), reward=reward.score(rollout))

    records `timing/values_s`, `timing/ref_log_prob_s`, `timing/reward_s` (each call's own time)
    and `timing/stage2_s` (the stage's wall time, about the slowest of them, not their sum).
    """

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._start = time.perf_counter()

    async def one(self, name: str, call: Awaitable[Any]) -> Any:
        """Await one call as its own stage."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.timings[f"timing/{name}_s"] = time.perf_counter() - start

    async def together(self, stage: str, **calls: Awaitable[Any]) -> list[Any]:
        """Await calls already started, in keyword order; if one fails the others are cancelled."""
        start = time.perf_counter()

        async def timed(name: str, call: Awaitable[Any]) -> Any:
            result = await call
            self.timings[f"timing/{name}_s"] = time.perf_counter() - start
            return result

        tasks = [asyncio.ensure_future(timed(name, call)) for name, call in calls.items()]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        finally:
            self.timings[f"timing/{stage}_s"] = time.perf_counter() - start

    def step_s(self) -> float:
        return time.perf_counter() - self._start


class MetricsLog:
    """RUN_DIR/metrics.jsonl: one JSON object per step, flushed as it is written."""

    def __init__(self, run_dir: str) -> None:
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        self._file: TextIO | None = None
        self.rewards: list[float] = []

    def __enter__(self) -> MetricsLog:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def write(self, record: dict[str, Any]) -> None:
        self.rewards.append(float(record["reward/mean"]))
        if self._file is not None:
            self._file.write(json.dumps(record, default=float) + "\n")
            self._file.flush()

    def summary(self) -> dict[str, Any]:
        """First / last mean reward, and the means of the first and last quarter of the steps."""
        r = self.rewards
        if not r:
            return {"steps": 0}
        q = max(1, len(r) // 4)
        return {
            "steps": len(r), "reward_first": r[0], "reward_last": r[-1],
            "reward_first_quarter": statistics.fmean(r[:q]), "reward_last_quarter": statistics.fmean(r[-q:]),
            "metrics": str(self.path) if self.path else None,
        }


def reward_stats(scores: list[float]) -> dict[str, float]:
    """reward/mean, max, min and accuracy (share of scores >= 1) of one step's samples."""
    return {
        "reward/mean": statistics.fmean(scores), "reward/max": max(scores), "reward/min": min(scores),
        "reward/accuracy": sum(s >= 1.0 for s in scores) / len(scores),
    }


def rollout_metrics(meta: Mapping[str, Any]) -> dict[str, float]:
    """The actor's generation timings and memory from a rollout's meta, under `rollout/`."""
    return {f"rollout/{k}": float(v) for k, v in meta.items() if k.startswith(("timing/", "memory/"))}
