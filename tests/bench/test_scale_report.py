"""How `hfrt bench scale` reports (no processes): the per-rank costs and the 16,384-rank prediction
from a straight-line fit, the targets judged at 1,024 ranks, and the docs table; and the figures
docs/bench-and-performance.md (Scale) states are the committed run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hfrt.bench.scale import TARGETS, fit, judge, markdown, per_rank

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "scale-2026-11-28.json"
#: the committed run of the day before (CPU targets missed), which the page still cites
EARLIER = ROOT / "bench" / "results" / "scale-2026-11-27.json"


def row(ranks: int, **over: Any) -> dict[str, Any]:
    base = {"ranks": ranks, "step_ranks": ranks, "heartbeat_s": 2.0, "ready_s": 1.0, "broadcast_p50_ms": 1.0,
            "broadcast_p99_ms": 2.0, "dispatch_p50_ms": 1.0, "step_overhead_ms": 1.0, "replace_s": 1.0,
            "controller_cpu_ms_per_broadcast": 0.02 * ranks, "controller_cpu_ms_per_dispatch": 0.03 * ranks,
            "controller_cpu_s_per_step": 0.0002 * ranks, "controller_peak_rss_mb": 50.0, "false_deaths": 0,
            "controller_cpu_ms_per_broadcast_net": 0.02 * ranks, "controller_cpu_ms_per_dispatch_net": 0.03 * ranks,
            "controller_cpu_s_per_step_net": 0.0002 * ranks, "controller_idle_cpu_ms_per_s": 0.01 * ranks,
            "detect_dead_s": 3.5, "peer_directory_bytes": 0, "peer_directory_bytes_run": 100 * ranks}
    return base | over


def test_a_line_through_the_points_predicts_16384_ranks() -> None:
    assert fit([(256, 5.0), (1024, 20.0)]) == pytest.approx((15 / 768, 0.0), abs=1e-9)
    assert fit([(100, 7.0)]) == (0.07, 0.0), "one point: a line through the origin"
    out = per_rank([row(2), row(256), row(1024)])
    assert out["cpu_ms_per_broadcast_us_per_rank"] == 20.0 and out["cpu_ms_per_dispatch_us_per_rank"] == 30.0
    assert out["idle_cpu_ms_per_s_us_per_rank"] == 10.0  # heartbeats: µs of CPU per rank per second
    assert out["predicted_16384_cpu_ms_per_broadcast"] == pytest.approx(0.02 * 16384, rel=1e-3)
    assert out["predicted_16384_cpu_s_per_step"] == pytest.approx(0.0002 * 16384, rel=1e-3)


def test_targets_are_judged_at_1024_ranks_only() -> None:
    assert judge([row(2), row(256)]) == {}
    met = judge([row(64), row(1024)])
    assert set(TARGETS) <= set(met) and met["controller_cpu_ms_per_broadcast"] and met["detect_dead_s"]
    assert met["peer_directory_bytes_n_log_n"] and met["peer_directory_bytes_start"]
    missed = judge([row(64), row(1024, detect_dead_s=4.1, peer_directory_bytes_run=100 * 1024 * 1024)])
    assert not missed["detect_dead_s"] and not missed["peer_directory_bytes_n_log_n"]


def page_text() -> str:
    return " ".join((ROOT / "docs" / "bench-and-performance.md").read_text().split())  # lines joined


def test_the_docs_table_and_figures_are_the_committed_runs() -> None:
    result = json.loads(RESULT.read_text())
    page = (ROOT / "docs" / "bench-and-performance.md").read_text()
    for line in markdown(result["rows"]):
        assert line in page, f"docs/bench-and-performance.md lacks the committed row {line!r}"
    text = page_text()
    for key in ("cpu_ms_per_broadcast_us_per_rank", "cpu_ms_per_dispatch_us_per_rank", "cpu_s_per_step_us_per_rank",
                "idle_cpu_ms_per_s_us_per_rank"):
        assert f"**{result[key]:.1f} µs**" in text, key
    assert (f"{result['predicted_16384_cpu_ms_per_broadcast'] / 1e3:.2f} s of controller CPU per broadcast, "
            f"{result['predicted_16384_cpu_ms_per_dispatch'] / 1e3:.2f} s per dispatch and "
            f"{result['predicted_16384_cpu_s_per_step']:.1f} s per PPO step, and "
            f"{result['predicted_16384_idle_cpu_ms_per_s'] / 1e3:.2f} s per second for heartbeats") in text
    assert round(result["predicted_16384_idle_cpu_ms_per_s"] / 1e3 * 2 / 10, 2) == 0.11, "at a 10 s heartbeat: about a tenth of a core"
    assert result["load_avg"] == [3.64, 2.62, 2.22] and "load average 3.6 / 2.6 / 2.2" in text
    at = {r["ranks"]: r for r in result["rows"]}
    big = at[1024]
    assert (f"every target is met: the controller's CPU per broadcast, {big['controller_cpu_ms_per_broadcast']:.1f} ms "
            f"({big['controller_cpu_ms_per_broadcast_net']:.1f} ms net of heartbeats) against ≤ 25, and per dispatch, "
            f"{big['controller_cpu_ms_per_dispatch']:.1f} ms ({big['controller_cpu_ms_per_dispatch_net']:.1f} ms net) against ≤ 40") in text
    assert big["controller_cpu_ms_per_broadcast"] <= 25 and big["controller_cpu_ms_per_dispatch"] <= 40
    met = result["targets_met"]
    assert set(TARGETS) <= set(met) and all(met.values()), met
    soak = big["soak_rss_mb_every_100"]
    assert big["soak_steps"] == 1000 and len(soak) == 10 and max(soak) <= 400
    assert (f"{big['soak_rss_mb_first']:.1f} MB after its first tenth, {big['soak_rss_mb_last']:.1f} MB at its end" in text
            and ", ".join(f"{v:.1f}" for v in soak[1:-2]) + f" and {soak[-2]:.1f} MB" in text)
    assert max(soak[4:]) - min(soak[4:]) <= 0.2 and "flat from step 500 on" in text
    assert round(big["soak_rss_mb_last"] - big["soak_rss_mb_after_malloc_trim"]) == 1 and "gives back about 1 MB" in text
    assert f"in a run of {big['run_s']:.0f} s with {big['calls_sent'] / 1e6:.1f} million calls" in text
    assert f"{big['peer_directory_bytes_run']:,} bytes over a whole 1,024-rank run" in text
    assert f"{big['trace_spans_per_step']:,.0f} spans, {big['trace_bytes_per_step'] / 1e3:,.0f} kB a PPO step" in text
    assert round(big["trace_bytes_per_step"] / big["trace_spans_per_step"]) == 135 and "about 135 bytes a span" in text
    assert f"a call to 1,024 ranks takes {big['broadcast_p50_ms']:.0f} ms (p50)" in text
    assert f"{at[256]['ready_s']:.1f} s after their hosts start" in text
    assert (f"broadcast to 64 ranks takes {at[64]['broadcast_p50_ms']:.1f} ms, to 256 {at[256]['broadcast_p50_ms']:.1f} ms"
            in text)
    first = json.loads((ROOT / "bench" / "results" / "scale-2026-11-27-first.json").read_text())
    at_first = {r["ranks"]: r for r in first["rows"]}
    big4k = json.loads((ROOT / "bench" / "results" / "scale-4096-2026-11-28.json").read_text())
    row4k = big4k["rows"][-1]
    assert row4k["ranks"] == 4096 and row4k["false_deaths"] == 0 and markdown(big4k["rows"])[-1] in page
    assert f"in {row4k['run_s']:.0f} s against {at_first[4096]['run_s']:.0f} s on the code of the day before" in text
    assert (f"{at_first[4096]['ready_s']:.1f} s ready, {at_first[4096]['broadcast_p50_ms']:.1f} ms broadcast p50, "
            f"{at_first[4096]['step_overhead_ms']:.0f} ms a PPO step and {at_first[4096]['controller_peak_rss_mb']:.0f} MB") in text
    assert [round(x, 1) for x in big4k["load_avg"]] == [5.6, 2.7, 2.7] and "load 5.6 / 2.7 / 2.7" in text
    earlier = {r["ranks"]: r for r in json.loads(EARLIER.read_text())["rows"]}
    assert (f"{at_first[1024]['controller_cpu_ms_per_broadcast']:.1f} ms before (`bench/results/scale-2026-11-27-first.json`), "
            f"{earlier[1024]['controller_cpu_ms_per_broadcast']:.1f} ms after") in text
    soak = json.loads((ROOT / "bench" / "results" / "scale-soak-1024-2026-11-27.json").read_text())["rows"][-1]
    assert (f"26.5 → {big['controller_cpu_ms_per_broadcast']:.1f} ms of CPU per broadcast and "
            f"41.9 → {big['controller_cpu_ms_per_dispatch']:.1f} ms per dispatch") in text
    assert (round(soak["controller_cpu_ms_per_broadcast"], 1), round(soak["controller_cpu_ms_per_dispatch"], 1)) == (26.5, 41.9)


def test_the_docs_before_figures_are_the_committed_run_before_the_changes() -> None:
    before = {r["ranks"]: r for r in json.loads((ROOT / "bench" / "results" / "scale-2026-11-27-before.json").read_text())["rows"]}
    text = page_text()
    assert (round(before[64]["peer_directory_bytes"] / 1e6, 1), round(before[256]["peer_directory_bytes"] / 1e6)) == (10.9, 658)
    assert (round(before[256]["ready_s"], 1), round(before[256]["controller_peak_rss_mb"])) == (18.6, 737)
    assert ("10.9 MB at 64 ranks and **658 MB at 256** (N³ bytes), 18.6 s to start 256 daemons and 737 MB of controller memory"
            in text)


def test_the_later_runs_the_page_cites_say_what_it_says() -> None:
    """The 256-rank soak levels off and malloc_trim frees nothing; busy daemons send no beats; the
    1,024-rank run after the heartbeat change costs what the page says."""
    page = " ".join((ROOT / "docs" / "bench-and-performance.md").read_text().split())
    soak = json.loads((ROOT / "bench" / "results" / "scale-soak-256-2026-11-27.json").read_text())
    series = soak["soak_rss_mb_every_100"]
    assert len(series) == 10 and max(series[4:]) - min(series[4:]) < 1.0, "flat over the last 600 steps"
    assert f"levels off: {series[0]:.1f} MB after its first tenth, {series[3]:.1f} MB at step 400" in page
    assert f"{series[4]:.1f} MB from step 500 to step 1,000 (one sample of {max(series):.1f})" in page
    assert f"gives back nothing ({soak['soak_rss_mb_after_malloc_trim']:.1f} MB)" in page
    assert soak["heartbeats_per_s_broadcasting"] == 0 and f"against {soak['heartbeats_per_s_idle']:.0f} while idle" in page
    after = json.loads((ROOT / "bench" / "results" / "scale-1024-after-beats-2026-11-27.json").read_text())["rows"][-1]
    assert after["ranks"] == 1024
    assert (f"took {after['controller_cpu_ms_per_broadcast']:.1f} ms of CPU per broadcast and "
            f"{after['controller_cpu_ms_per_dispatch']:.1f} ms per dispatch") in page


def test_the_1024_rank_soak_is_flat_as_the_page_says() -> None:
    """3,000 steps at 1,024 ranks: memory flat from step 500 on, no false death, and the page's numbers are the file's."""
    page = " ".join((ROOT / "docs" / "bench-and-performance.md").read_text().split())
    row = json.loads((ROOT / "bench" / "results" / "scale-soak-1024-2026-11-27.json").read_text())["rows"][-1]
    series = row["soak_rss_mb_every_100"]
    assert row["ranks"] == 1024 and row["soak_steps"] == 3000 and len(series) == 30 and row["false_deaths"] == 0
    assert max(series[4:]) - min(series[4:]) <= 0.2, "flat over the last 2,500 steps"
    assert f"{series[0]:.1f} MB at step 100, {series[4]:.1f} MB at step 500" in page
    assert f"{min(series[4:]):.1f}–{max(series[4:]):.1f} MB at every sample from there to step 3,000" in page
    assert f"; {row['soak_rss_mb_last']:.1f} at the end, {row['soak_rss_mb_after_malloc_trim']:.1f} after `malloc_trim`)" in page
    assert f"no false death in its {row['soak_s']:.0f} s" in page
    assert (f"{row['controller_cpu_ms_per_broadcast']:.1f} ms of controller CPU per broadcast and "
            f"{row['controller_cpu_ms_per_dispatch']:.1f} ms per dispatch") in page
    assert (f"broadcast p50 {row['broadcast_p50_ms']:.1f} ms, dispatch p50 {row['dispatch_p50_ms']:.1f} ms, "
            f"PPO step {row['step_overhead_ms']:.0f} ms, death found in {row['detect_dead_s']:.1f} s") in page


def test_the_ten_minute_run_on_the_new_code_says_what_the_page_says() -> None:
    """3,000 steps at 1,024 ranks on the code that meets the CPU targets: no false death in over
    ten minutes, memory flat from step 500, and both CPU targets met there too."""
    page = page_text()
    result = json.loads((ROOT / "bench" / "results" / "scale-soak-1024-2026-11-28.json").read_text())
    row = result["rows"][-1]
    series = row["soak_rss_mb_every_100"]
    assert row["ranks"] == 1024 and row["soak_steps"] == 3000 and row["false_deaths"] == 0 and row["soak_s"] >= 600
    assert max(series[4:]) - min(series[4:]) <= 0.2 and all(result["targets_met"].values())
    assert (f"no false death in {row['soak_s']:.0f} s and {row['calls_sent'] / 1e6:.1f} million calls, memory "
            f"{series[3]:.1f} MB at step 400 and {series[4]:.1f} MB at every sample from step 500 to step 3,000, "
            f"{row['controller_cpu_ms_per_broadcast']:.1f} ms of CPU per broadcast and "
            f"{row['controller_cpu_ms_per_dispatch']:.1f} ms per dispatch, death found in {row['detect_dead_s']:.1f} s") in page
    assert round(result["load_avg"][0], 1) == 3.7 and "load 3.7" in page
