"""`hfrt bench vs-trl`'s shapes: the tool-schema prefix goes before every prompt on both sides,
its JSON's shape names the mean prompt length and TRL's mode, and TRL's vLLM colocate arguments
are what GRPOConfig takes."""

from __future__ import annotations

import dataclasses

import pytest

from hfrt.bench.vs_trl import Shape, prompt_rows
from hfrt.bench.vs_trl_shapes import TOOLS_SYSTEM, mean_prompt_tokens, trl_mode, trl_vllm_args, with_prefix


def test_the_tools_prefix_goes_before_every_prompt_and_nothing_else_changes() -> None:
    bare = prompt_rows(Shape(prompts=3), steps=2)
    long = prompt_rows(Shape(prompts=3, prompt_prefix="tools"), steps=2)
    assert long["prompt"] == [TOOLS_SYSTEM + p for p in bare["prompt"]]
    assert long["ground_truth"] == bare["ground_truth"]
    assert '"name": "multiply"' in TOOLS_SYSTEM and "<tools>" in TOOLS_SYSTEM
    with pytest.raises(ValueError, match="prompt prefix 'tool'"):
        with_prefix(bare, "tool")


def test_mean_prompt_tokens_counts_as_the_tokenizer_does() -> None:
    from hfrt.roles.models import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()  # one token per byte
    assert mean_prompt_tokens(tokenizer, ["ab", "abcd"]) == 3.0
    assert mean_prompt_tokens(tokenizer, [TOOLS_SYSTEM]) >= 256


def test_trl_vllm_colocate_arguments_are_grpo_config_fields() -> None:
    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    args = trl_vllm_args(True, 512)
    assert args["use_vllm"] is True and args["vllm_mode"] == "colocate"
    assert set(args) <= fields, set(args) - fields
    assert trl_vllm_args(False, 512) == {}
    assert (trl_mode(True), trl_mode(False)) == ("vllm-colocate", "transformers-generate")


def test_the_docs_rows_are_the_committed_runs() -> None:
    """Every committed run of 2026-11-27 appears as its row in docs/bench-and-performance.md, and
    the long-prompt shape is the one the issue names (prompt >= 256 tokens, n = 8, 32 new tokens)."""
    import json
    import statistics
    from pathlib import Path

    from hfrt.bench.vs_trl_shapes import shape_label, table_row

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "bench-and-performance.md").read_text()
    runs = sorted((root / "bench" / "results").glob("vs-trl-2026-11-27-smollm2-vllm-*.json"))
    assert runs, "no committed vs-trl run of 2026-11-27"
    groups: dict[str, list[float]] = {}
    for path in runs:
        result = json.loads(path.read_text())
        row = table_row(result, f"../bench/results/{path.name}")
        assert row in page, f"docs/bench-and-performance.md lacks the row of {path.name}:\n{row}"
        if result["shape"]["prompt_prefix"] == "tools":
            assert result["shape"]["prompt_tokens"] >= 256 and result["shape"]["n"] == 8 and result["shape"]["max_new_tokens"] == 32
        groups.setdefault(shape_label(result["shape"]), []).append(result["speedup"])
    text = " ".join(page.split())
    for label, speedups in groups.items():  # the page states each shape's median over its runs
        assert f"{label}: median {statistics.median(speedups):.2f}× over {len(speedups)} run" in text, label
