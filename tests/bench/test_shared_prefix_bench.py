"""bench/shared_prefix.py and the figures docs/bench-and-performance.md takes from its committed run:
the long-prompt shape's token counts (exact, re-derived here), the run's speedups and exactness as
the page states them, and the re-measurement check's floors."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hfrt.bench import shared_prefix as bench

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "shared-prefix-2026-11-27.json"
PAGE = ROOT / "docs" / "bench-and-performance.md"


def section() -> str:
    text = PAGE.read_text()
    start = text.index("## Shared-prefix forwards")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_shapes_token_counts_are_the_documented_ones() -> None:
    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training.engines import EngineConfig, build_train_engine
    from hfrt.roles.training.engines import shared_prefix as sp

    model = load_model(ModelConfig("tiny"))
    batch = bench.grouped_batch(model.config.vocab_size, 2, 8, 256, 32)
    counts = {}
    for shared in (False, True):
        engine = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=16, shared_prefix=shared))
        counts[shared] = sum(sp.computed_tokens(m) for m in engine.micro_batches(batch))
    run = json.loads(RESULT.read_text())["models"]["tiny"]
    assert counts == {False: run["tokens_computed"]["unshared"], True: run["tokens_computed"]["shared"]}
    text = section()
    assert f"{counts[False]:,}" in text and f"{counts[True]:,}" in text


def test_the_page_states_the_committed_run() -> None:
    result = json.loads(RESULT.read_text())
    text = section()
    assert result["shape"] == {"prompts": 2, "n": 8, "prompt_tokens": 256, "new_tokens": 32, "micro_batch_size": 16}
    for name, run in result["models"].items():
        assert run["max_log_prob_diff"] < 1e-4 and run["max_grad_diff"] < 1e-5, name  # fp32 rounding (30 layers)
        for p in bench.PASSES:
            assert f"{run[p]['speedup']:.2f}×" in text, (name, p)
            assert run[p]["speedup"] >= result["documented"][name][p], (name, p)  # the floor the check holds
    floors = re.findall(r"at least\s+([\d.]+)×", text)
    assert sorted(float(f) for f in floors) == sorted(v for d in result["documented"].values() for v in d.values())


def test_check_names_each_measured_speedup_below_its_floor() -> None:
    result = {"models": {"tiny": {"reference": {"speedup": 2.0}, "update": {"speedup": 1.1}}}}
    misses = bench.check(result, {"tiny": {"reference": 1.5, "update": 1.5}, "smollm2-135m": {"update": 2.0}})
    assert misses == ["tiny update: speedup 1.1 below the documented floor 1.5"]  # smollm2-135m: not measured
