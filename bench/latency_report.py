"""How `hfrt bench latency` prints its figures: a table of measurements, then each target with the
figure it is judged on and whether this run met it.

It knows the latency result's keys and targets; nothing of how they were measured. A target missed
on a loaded or slow machine is reported as missed on this run, not as a failure of the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: where the targets and the machines they were met on are written down
TARGETS_PAGE = "docs/bench-and-performance.md#performance-notes"
#: how to get the Ray reference
RAY_HINT = 'pip install -e ".[bench]" for the Ray reference'


@dataclass(frozen=True)
class Target:
    """A bound on one result figure: `figure op bound` (op "≤" or "≥"), optionally a stricter stretch."""

    label: str
    key: str
    op: str
    bound: float
    unit: str
    stretch: float | None = None

    def met(self, value: float, bound: float | None = None) -> bool:
        limit = self.bound if bound is None else bound
        return value <= limit if self.op == "≤" else value >= limit


#: the latency targets (docs/bench-and-performance.md, Performance notes)
TARGETS = (
    Target("hfrt / raw sync pyzmq round trip (p50)", "hfrt_vs_raw_p50", "≤", 2.5, "×", stretch=1.5),
    Target("hfrt pipelined calls/s", "hfrt_calls_per_s", "≥", 20000, "calls/s"),
    Target("hfrt / Ray actor call (p50)", "hfrt_vs_ray_p50", "≤", 0.25, "×"),
)


def figure(value: float | int, unit: str) -> str:
    """`value` with its unit ("×" sticks to the number, other units follow a space)."""
    return f"{value:g}{unit}" if unit == "×" else f"{value:g} {unit}"


def row(name: str, value: float | int | str | None, unit: str, note: str = "") -> str:
    """One table line: a figure with its unit and note, or a status ("not installed") with neither."""
    shown = figure(value, unit) if isinstance(value, int | float) else str(value)
    return f"{name:<40} {shown}" + (f"  ({note})" if note else "")


def target_line(target: Target, value: float | int | None, missing: str) -> str:
    """One target judged on this run's figure: met, not met, or not measured (`missing` says why)."""
    bound = f"target {target.op} {figure(target.bound, target.unit)}"
    if target.stretch is not None:
        bound += f", stretch {target.op} {figure(target.stretch, target.unit)}"
    if value is None:
        return f"  {target.label}: {bound}: not measured ({missing})"
    if not target.met(value):
        verdict = "not met on this run"
    elif target.stretch is not None:
        verdict = "met, stretch met" if target.met(value, target.stretch) else "met, stretch not met"
    else:
        verdict = "met"
    return f"  {target.label}: {bound}: {figure(value, target.unit)} ({verdict})"


def targets_met(result: dict[str, Any]) -> dict[str, bool | None]:
    """Each target's key → whether this run met it (None: not measured)."""
    return {t.key: None if result.get(t.key) is None else t.met(result[t.key]) for t in TARGETS}


def report(result: dict[str, Any], *, inflight: int, fanout: int, ray_missing: str) -> list[str]:
    """The lines `hfrt bench latency` prints: the figures, then the targets judged on them.
    `ray_missing` says why there is no Ray figure when there is none ("not installed", "skipped (--no-ray)")."""
    ray = result.get("ray_p50_us")
    lines = [
        row("hfrt no-op round trip p50", result["hfrt_p50_us"], "µs"),
        row("hfrt no-op round trip p99", result["hfrt_p99_us"], "µs"),
        row(f"hfrt pipelined ({inflight} in flight)", result["hfrt_calls_per_s"], "calls/s"),
        row(f"hfrt fan-out to {fanout} daemons p50", result[f"fanout{fanout}_p50_us"], "µs"),
        row("raw sync pyzmq REQ/REP p50", result["raw_zmq_p50_us"], "µs"),
        row("asyncio+zmq echo floor p50", result["asyncio_zmq_floor_p50_us"], "µs", "event loop on both ends, no hfrt"),
        row("Ray actor call p50", ray, "µs") if ray is not None else row("Ray actor call p50", ray_missing, "", RAY_HINT),
        row("hfrt / raw pyzmq (p50)", result["hfrt_vs_raw_p50"], "×"),
        row("floor / raw pyzmq (p50)", result["floor_vs_raw_p50"], "×", "the event loop's share"),
        row("hfrt - floor (p50)", result["hfrt_own_us"], "µs", "hfrt's own work per round trip"),
        row("hfrt / Ray (p50)", result.get("hfrt_vs_ray_p50") if ray is not None else "not measured", "×"),
        "",
        f"targets, judged on this run (a loaded or slow machine misses them; see {TARGETS_PAGE}):",
    ]
    return lines + [target_line(t, result.get(t.key), f"Ray {ray_missing}") for t in TARGETS]
