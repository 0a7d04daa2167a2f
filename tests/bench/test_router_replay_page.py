"""docs/moe-routing-replay.md holds the committed routing-replay figures: its table's rows and its
cost figures are rendered from bench/results/router-replay-2026-11-27.json and must appear on the
page verbatim, and the file's own check passed (`failed` empty)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "router-replay-2026-11-27.json"
PAGE = ROOT / "docs" / "moe-routing-replay.md"
LABELS = {"fp32": "fp32", "bf16": "bf16", "stale": "stale (async, 1 update old)"}


def _share(run: dict[str, Any], key: str) -> str:
    got = run[f"router_mismatch/{key}"]
    return f"{got['median'] * 100:.3f} % / {got['max'] * 100:.3f} %"


def rows(results: dict[str, Any]) -> list[str]:
    """The page's table rows, from the results file."""
    out = []
    for name, run in results["runs"].items():
        if run["router_replay"] is None:
            continue
        gap, kl = run["router_mismatch/log_prob_abs_diff"]["median"], run["router_mismatch/k3_kl"]["median"]
        out.append(f"| {LABELS[name.split('_')[0]]} | {str(run['router_replay']).lower()} | {_share(run, 'share')} | "
                   f"{_share(run, 'own_share')} | {gap:.1e} | {kl:.1e} |")
    return out


def cost_figures(results: dict[str, Any]) -> list[str]:
    """The cost sentences: medians (s) absent / off / on and on ÷ absent, per timed pass."""
    c = results["cost"]
    m, r = c["median_s"], c["vs_absent"]["on"]
    return [f"{m['absent'][k]:.3f} s absent, {m['off'][k]:.3f} s off, {m['on'][k]:.3f} s on ({r[k]:.2f}× with replay)"
            for k in ("update_s", "log_prob_s")]


def test_page_table_is_the_results_file() -> None:
    results = json.loads(RESULTS.read_text())
    page = PAGE.read_text()
    assert results["failed"] == []
    for row in rows(results):
        assert row in page, f"docs/moe-routing-replay.md lacks the row\n{row}"
    flat = " ".join(page.split())
    for figure in cost_figures(results):
        assert " ".join(figure.split()) in flat, f"docs/moe-routing-replay.md lacks the cost figure {figure!r}"
    assert f"{results['column']['bytes_per_token']} bytes a token for `tiny-moe`" in flat


if __name__ == "__main__":
    print("\n".join(rows(json.loads(RESULTS.read_text()))))
