"""`hfrt plot RUN_DIR`: a run's curves drawn from RUN_DIR/metrics.jsonl into a PNG (matplotlib,
Agg: no display needed) — reward, validation (with the one before training), KL, entropy, and the
per-stage step timings.

It knows metric names (reward/mean, val/*, val_before/*, names holding `kl` or `entropy`,
timing/<stage>_s); nothing of how a run produced them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfrt.flows.timing import Stage

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: the stages of a step, in the order they run (stacked bottom to top)
STAGES = (Stage.GENERATE, Stage.STAGE2, Stage.OLD_LOG_PROB, Stage.ADVANTAGES, Stage.UPDATE)
#: a KL metric: `kl` as a whole word of the name (kl/mean, actor/kl_loss, actor/ppo_kl, actor/reward_kl_penalty)
KL_NAME = re.compile(r"(^|[/_])kl($|[/_])")
#: KL settings logged beside the KL figures (a coefficient is not a divergence)
NOT_KL = re.compile(r"coef")


@dataclass(frozen=True)
class Line:
    """One curve: its legend label, x (steps) and y, and a matplotlib format string."""

    label: str
    steps: list[int]
    values: list[float]
    style: str = "-"


@dataclass(frozen=True)
class Panel:
    """One axes of the figure: a title, a y label, its curves and a note (drawn at the right of the title)."""

    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    note: str = ""


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


def series(records: list[dict[str, Any]], key: str, shift: int = 0) -> tuple[list[int], list[float]]:
    """(steps + shift, values) of the records that have a number under `key`."""
    points = [(int(r["step"]) + shift, float(r[key])) for r in records if _is_number(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def validation_line(records: list[dict[str, Any]], key: str) -> Line:
    """`key` (a val/* name) drawn where it was measured, in steps done: the pass before training
    (val_before/*, in step 0's record) at 0, the pass after step s at s + 1."""
    before_steps, before = series(records, key.replace("val/", "val_before/", 1))
    after_steps, after = series(records, key, shift=1)
    return Line(key, before_steps + after_steps, before + after, "o--")


def panels(records: list[dict[str, Any]]) -> list[Panel]:
    """The line panels of a run, top to bottom — reward, validation, KL, entropy — each holding only
    metrics the run logged; a panel with none is left out."""
    names = _numeric_names(records)
    val_keys = [k for k in names if k.startswith("val/")]
    val_keys += [k.replace("val_before/", "val/", 1) for k in names
                 if k.startswith("val_before/") and k.replace("val_before/", "val/", 1) not in val_keys]
    candidates = [
        Panel("reward", "reward", [Line("reward/mean", *series(records, "reward/mean"))]),
        Panel("validation", "validation", [validation_line(records, k) for k in val_keys],
              note="drawn at steps done: before training at 0, after step s at s + 1"),
        Panel("KL", "KL", [Line(k, *series(records, k)) for k in names
                           if KL_NAME.search(k) and not NOT_KL.search(k) and not k.startswith("timing/")]),
        Panel("entropy", "nats per token", [Line(k, *series(records, k)) for k in names if "entropy" in k]),
    ]
    return [Panel(p.title, p.ylabel, [line for line in p.lines if line.values], p.note) for p in candidates
            if any(line.values for line in p.lines)]


def figure(records: list[dict[str, Any]], title: str) -> Figure:
    """The whole figure: the line panels of `panels`, then the stage timings stacked, one shared step axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    drawn = panels(records)
    fig = Figure(figsize=(10, 2.4 * (len(drawn) + 1) + 0.6), layout="constrained")
    axes = fig.subplots(len(drawn) + 1, 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, drawn, strict=False):
        _draw_panel(ax, panel)
    _draw_timings(axes[-1], records)
    fig.suptitle(title)
    return fig


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw RUN_DIR/metrics.jsonl (see `figure`); writes `out` (default RUN_DIR/metrics.png) and returns it."""
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    out = Path(out) if out is not None else Path(run_dir) / "metrics.png"
    fig = figure(records, Path(run_dir).resolve().name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _draw_panel(ax: Any, panel: Panel) -> None:
    for line in panel.lines:
        ax.plot(line.steps, line.values, line.style, label=line.label)
    ax.set_title(panel.title, loc="left", fontsize="medium")
    if panel.note:
        ax.set_title(panel.note, loc="right", fontsize="small")
    ax.set_ylabel(panel.ylabel)
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
    ax.set_title("step timings", loc="left", fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if stacks or total:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def _numeric_names(records: list[dict[str, Any]]) -> list[str]:
    """Every key that holds a number in some record, in first-seen order."""
    names: dict[str, None] = {}
    for record in records:
        names.update((k, None) for k, v in record.items() if k != "step" and _is_number(v))
    return list(names)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any) -> float:
    """A stage's time, 0 where a record lacks it (a stack needs a value at every step)."""
    if _is_number(value) and not math.isnan(value):
        return float(value)
    return 0.0
