"""`hfrt plot RUN_DIR`: the reward curve and the per-stage step timings of a run, drawn from
RUN_DIR/metrics.jsonl into a PNG (matplotlib, Agg: no display needed).

It knows metric names (reward/mean, val/reward_mean, timing/<stage>_s); nothing of how a run
produced them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: the stages of a step, in the order they run (stacked bottom to top)
STAGES = ("generate", "stage2", "old_log_prob", "advantages", "update")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a line cut short by a kill is skipped); ValueError if there
    is no file or no record."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (is {path.parent} an hfrt run folder?)")
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no metric records yet")
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a number under `key`."""
    points = [(int(r["step"]), float(r[key])) for r in records if isinstance(r.get(key), int | float)]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw RUN_DIR/metrics.jsonl: reward/mean (and val/reward_mean) per step above, the stage
    timings per step stacked below; writes `out` (default RUN_DIR/metrics.png) and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    out = Path(out) if out is not None else Path(run_dir) / "metrics.png"
    fig = Figure(figsize=(10, 7), layout="constrained")
    reward_ax, timing_ax = fig.subplots(2, 1, sharex=True)
    _draw_rewards(reward_ax, records)
    _draw_timings(timing_ax, records)
    fig.suptitle(Path(run_dir).resolve().name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _draw_rewards(ax: Any, records: list[dict[str, Any]]) -> None:
    steps, rewards = series(records, "reward/mean")
    ax.plot(steps, rewards, label="reward/mean")
    val_steps, val = series(records, "val/reward_mean")
    if val:
        ax.plot(val_steps, val, "o--", label="val/reward_mean")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def _draw_timings(ax: Any, records: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = [int(r["step"]) for r in records]
    stacks = {
        stage: [_number(r.get(f"timing/{stage}_s")) for r in records]
        for stage in STAGES if any(f"timing/{stage}_s" in r for r in records)
    }
    if stacks:
        ax.stackplot(steps, *stacks.values(), labels=[f"timing/{s}_s" for s in stacks], alpha=0.8)
    total_steps, total = series(records, "timing/step_s")
    if total:
        ax.plot(total_steps, total, "k--", linewidth=1, label="timing/step_s")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if stacks or total:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def _number(value: Any) -> float:
    """A stage's time, 0 where a record lacks it (a stack needs a value at every step)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    return 0.0
