"""What `hfrt bench latency` prints (hfrt.bench.latency_report): figures with units, a missing
reference as a status without a unit, and each target judged on this run's figure — as
docs/bench-and-performance.md shows it."""

from __future__ import annotations

from typing import Any

import pytest

from hfrt.bench.latency_report import TARGETS, report, row, target_line, targets_met

#: a result as bench/latency.py builds it, on a loaded machine without Ray
RESULT: dict[str, Any] = {
    "hfrt_p50_us": 264.0, "hfrt_p99_us": 600.1, "hfrt_calls_per_s": 15700.4, "fanout4_p50_us": 571.0,
    "raw_zmq_p50_us": 83.0, "asyncio_zmq_floor_p50_us": 147.0, "ray_p50_us": None, "hfrt_vs_raw_p50": 3.18,
    "hfrt_vs_ray_p50": None, "floor_vs_raw_p50": 1.77, "hfrt_own_us": 117.0,
}
RAW, CALLS, RAY = TARGETS


def test_a_missing_reference_is_a_status_without_a_unit() -> None:
    lines = report(RESULT, inflight=64, fanout=4, ray_missing="not installed")
    ray = next(line for line in lines if line.startswith("Ray actor call p50"))
    assert ray.split(None, 4)[4].startswith("not installed") and "µs" not in ray and "n/a" not in ray
    assert next(line for line in lines if line.startswith("hfrt / Ray (p50)")).endswith(" not measured")
    assert not any("n/a" in line for line in lines)
    skipped = report(RESULT, inflight=64, fanout=4, ray_missing="skipped (--no-ray)")
    assert any(line.startswith("Ray actor call p50") and "skipped (--no-ray)" in line for line in skipped)


def test_figures_keep_their_units_and_notes_apart_from_targets() -> None:
    assert row("hfrt no-op round trip p50", 264.0, "µs") == f"{'hfrt no-op round trip p50':<40} 264 µs"
    assert row("hfrt / raw pyzmq (p50)", 3.18, "×") == f"{'hfrt / raw pyzmq (p50)':<40} 3.18×"
    lines = report(RESULT, inflight=64, fanout=4, ray_missing="not installed")
    table = lines[: lines.index("")]
    assert not any("target" in line for line in table)  # targets are printed as targets, below the figures


@pytest.mark.parametrize("value, verdict", [(1.4, "(met, stretch met)"), (1.91, "(met, stretch not met)"),
                                            (3.18, "(not met on this run)")])
def test_ratio_target_with_a_stretch(value: float, verdict: str) -> None:
    line = target_line(RAW, value, "unused")
    assert line == f"  hfrt / raw sync pyzmq round trip (p50): target ≤ 2.5×, stretch ≤ 1.5×: {value:g}× {verdict}"


def test_throughput_target_and_an_unmeasured_one() -> None:
    assert target_line(CALLS, 31399.8, "") == "  hfrt pipelined calls/s: target ≥ 20000 calls/s: 31399.8 calls/s (met)"
    assert target_line(CALLS, 15700.4, "").endswith(": 15700.4 calls/s (not met on this run)")
    assert target_line(RAY, None, "Ray not installed") == "  hfrt / Ray actor call (p50): target ≤ 0.25×: not measured (Ray not installed)"


def test_report_ends_with_every_target_and_the_result_records_them() -> None:
    lines = report(RESULT, inflight=64, fanout=4, ray_missing="not installed")
    assert lines[-4].startswith("targets, judged on this run")
    assert lines[-3:] == [target_line(RAW, 3.18, ""), target_line(CALLS, 15700.4, ""), target_line(RAY, None, "Ray not installed")]
    assert targets_met(RESULT) == {"hfrt_vs_raw_p50": False, "hfrt_calls_per_s": False, "hfrt_vs_ray_p50": None}


def test_the_docs_example_is_what_the_bench_prints() -> None:
    """docs/bench-and-performance.md shows the targets of a run at 1.91× raw and 15700.4 calls/s, without Ray."""
    from tests.docs.snippets import ROOT, blocks

    shown = [b for b in blocks(ROOT / "docs" / "bench-and-performance.md")
             if b.lang == "text" and b.arg == "tests/bench/test_latency_report.py"]
    assert len(shown) == 1
    result = RESULT | {"hfrt_vs_raw_p50": 1.91, "hfrt_calls_per_s": 15700.4}
    assert report(result, inflight=64, fanout=4, ray_missing="not installed")[-4:] == shown[0].text.strip("\n").splitlines()
