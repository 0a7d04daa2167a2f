"""Scale benchmark: the controller at 64 to 4,096 ranks on one machine (`hfrt bench scale`).

Each rank count runs in its own process (bench/scale_measure.py), with the 2-rank figures of the
same run as the baseline, so growth reads as a ratio. The daemons are simulated, many per process
(`hfrt daemon-host`): real sockets, identities, heartbeats, hellos, endpoint tables, directory
entries and protocol, no compute; everything shares this machine's cores, so wall-clock figures
include the daemons' work, and the controller's own CPU is the figure that carries over to a
cluster, where the daemons have machines of their own. Prints a table, the per-rank costs, the
controller CPU predicted for 16,384 ranks, and the targets judged at 1,024 ranks.
Run: `hfrt bench scale [--ranks 64,256,1024] [--json] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine

BASELINE = 2
#: the targets at TARGET_RANKS ranks: key → (bound, "max" | "min")
TARGET_RANKS = 1024
TARGETS = {
    "controller_cpu_ms_per_broadcast": 25.0, "controller_cpu_ms_per_dispatch": 40.0,
    "broadcast_p50_ms": 100.0, "dispatch_p50_ms": 150.0, "step_overhead_ms": 500.0,
    "ready_s": 15.0, "controller_peak_rss_mb": 400.0, "false_deaths": 0,
}
#: columns of the printed table: key, header, format
COLUMNS = (
    ("ranks", "ranks", "{:d}"), ("ready_s", "ready s", "{:.1f}"),
    ("broadcast_p50_ms", "bcast p50 ms", "{:.1f}"), ("broadcast_p99_ms", "p99", "{:.1f}"),
    ("dispatch_p50_ms", "disp p50 ms", "{:.1f}"), ("step_overhead_ms", "step ms", "{:.0f}"),
    ("controller_cpu_ms_per_broadcast", "cpu/bcast ms", "{:.2f}"),
    ("controller_cpu_ms_per_dispatch", "cpu/disp ms", "{:.2f}"),
    ("controller_cpu_s_per_step", "cpu/step s", "{:.3f}"), ("controller_peak_rss_mb", "rss MB", "{:.0f}"),
    ("detect_dead_s", "detect s", "{:.2f}"), ("replace_s", "replace s", "{:.2f}"),
    ("peer_directory_bytes_run", "dir bytes", "{:,d}"), ("trace_bytes_per_step", "trace B/step", "{:,.0f}"),
)


def run_one(ranks: int, args: argparse.Namespace, soak_steps: int = 0) -> dict[str, Any]:
    """Measure one rank count in a fresh process (its CPU and memory are the controller's alone)."""
    cmd = [sys.executable, "-m", "hfrt.bench.scale_measure", str(ranks), "--per-host", str(args.per_host),
           "--heartbeat", str(args.heartbeat), "--broadcasts", str(args.broadcasts), "--dispatches", str(args.dispatches),
           "--steps", str(args.steps), "--log-dir", str(Path(args.log_dir) / f"ranks-{ranks}"),
           "--soak-steps", str(soak_steps)]
    print(f"measuring {ranks} ranks ...", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{ranks} ranks failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def per_rank(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Controller CPU per rank at the largest count (µs), net of the heartbeat background, which is
    given per rank and second of its own; and a straight-line fit over the rank counts of 256 and
    more (cost = fixed + per-rank × N) predicting each at 16,384 ranks."""
    big = [r for r in rows if r["ranks"] >= 256] or rows[-1:]
    last = rows[-1]
    out: dict[str, Any] = {}
    for key, ranks_key, to_us in (("controller_cpu_ms_per_broadcast_net", "ranks", 1e3),
                                  ("controller_cpu_ms_per_dispatch_net", "ranks", 1e3),
                                  ("controller_cpu_s_per_step_net", "step_ranks", 1e6),
                                  ("controller_idle_cpu_ms_per_s", "ranks", 1e3)):
        what = key.removeprefix("controller_").removesuffix("_net")
        out[f"{what}_us_per_rank"] = round(last[key] * to_us / last[ranks_key], 2)
        slope, fixed = fit([(r[ranks_key], r[key]) for r in big])
        out[f"predicted_16384_{what}"] = round(fixed + slope * 16384, 3)
    return out


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y over x; one point: through the origin."""
    if len(points) == 1:
        x, y = points[0]
        return y / x, 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def judge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each target at TARGET_RANKS ranks (None when that count was not run): True when met."""
    row = next((r for r in rows if r["ranks"] == TARGET_RANKS), None)
    if row is None:
        return {}
    met: dict[str, Any] = {key: row[key] <= bound for key, bound in TARGETS.items()}
    met["detect_dead_s"] = row["detect_dead_s"] <= 2 * row["heartbeat_s"]
    met["peer_directory_bytes_start"] = row["peer_directory_bytes"] == 0
    small = next((r for r in rows if r["ranks"] >= 64), None)
    if small is not None and small is not row and small["peer_directory_bytes_run"] > 0:
        n0, n1 = small["ranks"], row["ranks"]  # the whole run's directory traffic grows no faster than N log N
        met["peer_directory_bytes_n_log_n"] = (row["peer_directory_bytes_run"] / small["peer_directory_bytes_run"]
                                               <= (n1 * math.log2(n1)) / (n0 * math.log2(n0)))
    return met


def table(rows: list[dict[str, Any]]) -> list[str]:
    widths = [max(len(h), 9) for _, h, _ in COLUMNS]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(COLUMNS, widths, strict=True))]
    for row in rows:
        cells = [fmt.format(row[key]) if key in row else "-" for key, _, fmt in COLUMNS]
        lines.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return lines


#: the docs table (docs/bench-and-performance.md, Scale): key, header, format
DOC_COLUMNS = (
    ("ranks", "ranks", "{:,d}"), ("ready_s", "ready", "{:.1f} s"),
    ("broadcast_p50_ms", "broadcast p50 / p99", "{:.1f} / {broadcast_p99_ms:.0f} ms"),
    ("dispatch_p50_ms", "dispatch p50", "{:.1f} ms"), ("step_overhead_ms", "PPO step", "{:.0f} ms"),
    ("controller_cpu_ms_per_broadcast", "CPU / broadcast (net)", "{:.1f} ({controller_cpu_ms_per_broadcast_net:.1f}) ms"),
    ("controller_cpu_ms_per_dispatch", "CPU / dispatch (net)", "{:.1f} ({controller_cpu_ms_per_dispatch_net:.1f}) ms"),
    ("controller_cpu_s_per_step", "CPU / step (net)", "{:.3f} ({controller_cpu_s_per_step_net:.3f}) s"),
    ("controller_idle_cpu_ms_per_s", "heartbeats' CPU", "{:.0f} ms/s"),
    ("controller_peak_rss_mb", "controller RSS", "{:.0f} MB"),
    ("detect_dead_s", "detect / replace", "{:.1f} / {replace_s:.1f} s"),
    ("peer_directory_bytes_run", "directory bytes (start / run)", "{peer_directory_bytes:,d} / {:,d}"),
)


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The results as the docs table (one row per rank count)."""
    lines = ["| " + " | ".join(h for _, h, _ in DOC_COLUMNS) + " |", "|" + "---|" * len(DOC_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key], **row) for key, _, fmt in DOC_COLUMNS) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench scale", description=__doc__)
    p.add_argument("--ranks", default="64,256,1024", help="comma-separated rank counts (the 2-rank baseline is always added)")
    p.add_argument("--per-host", type=int, default=256, help="most simulated daemons per daemon-host process")
    p.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat interval in seconds")
    p.add_argument("--broadcasts", type=int, default=100, help="broadcasts measured per rank count")
    p.add_argument("--dispatches", type=int, default=100, help="dispatches measured per rank count")
    p.add_argument("--steps", type=int, default=20, help="PPO steps measured per rank count")
    p.add_argument("--log-dir", default="runs/bench-scale", help="where the daemon hosts' logs go")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one rank count may take")
    p.add_argument("--soak-steps", type=int, default=0, help="at the largest rank count, this many PPO steps more (memory sampled at their first tenth and end)")
    add_output_flags(p)
    args = p.parse_args(argv)
    try:
        counts = sorted({BASELINE, *(int(n) for n in args.ranks.split(",") if n.strip())})
    except ValueError:
        p.error(f"--ranks {args.ranks!r}: expected comma-separated whole numbers")
    if counts[0] < 1:
        p.error("--ranks: every count must be at least 1")
    rows = [run_one(n, args, args.soak_steps if n == counts[-1] else 0) for n in counts]
    base = rows[0]
    for row in rows:
        for key in ("broadcast_p50_ms", "controller_cpu_ms_per_broadcast", "step_overhead_ms"):
            row[f"{key}_vs_baseline"] = round(row[key] / base[key], 1) if base[key] else None
    result: dict[str, Any] = {"rows": rows, **per_rank(rows), "targets_met": judge(rows), "transport": "tcp loopback",
                              "daemons": "simulated (hfrt daemon-host), no compute", **machine()}
    print("\n".join(table(rows)))
    print(json.dumps({k: v for k, v in result.items() if k.endswith("_us_per_rank") or k.startswith("predicted")}))
    print("targets at 1,024 ranks:", json.dumps(result["targets_met"]))
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
