"""docs/real-models.md holds the committed reasoning-gym figure: its table's rows are rendered from
bench/results/gym-smollm2-2026-11-27.json and must appear on the page verbatim, and the file's own
check (bench/recipes/gym_recipe.py: "after" beats "before" by the margin, greedy and sampled, and
beats always giving the most common answer) passed. The page's other figures — the recipes'
settings, the load, letter_counting's run and the screening of reasoning-gym's own prompts — are
held to their files too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "gym-smollm2-2026-11-27.json"
LETTERS = ROOT / "bench" / "results" / "gym-smollm2-2026-11-27-letter_counting.json"
LEGS = ROOT / "bench" / "results" / "gym-smollm2-2026-11-27-leg_counting.json"
SCREENING = ROOT / "bench" / "results" / "gym-smollm2-2026-11-27-screening.json"
PAGE = ROOT / "docs" / "real-models.md"


def _pair(figure: dict[str, Any], kind: str) -> str:
    """before → after: greedy on 100 rows to 2 decimals, sampled (4 per row) to 3."""
    digits = 2 if kind == "greedy" else 3
    return f"{figure['before'][kind]:.{digits}f} → {figure['after'][kind]:.{digits}f}"


def rows(results: dict[str, Any]) -> list[str]:
    """The page's table rows, from the results file."""
    return [f"| `{t['task']}` | {t['val_prompts']} | {_pair(t, 'greedy')} | {_pair(t, 'sampled')} | "
            f"{t['constant_answer']['share']:.2f} (`{t['constant_answer']['answer']}`) | {t['steps']} | "
            f"{t['wall_s']['train'] / 60:.0f} min |" for t in results["tasks"]]


def test_page_table_is_the_results_file() -> None:
    results = json.loads(RESULTS.read_text())
    page = PAGE.read_text()
    assert results["passed"] is True and results["failures"] == []
    assert len(results["tasks"]) >= 2  # the figure: at least two tasks
    for row in rows(results):
        assert row in page, f"docs/real-models.md lacks the row\n{row}"
    sampled = {(t["sampled"]["temperature"], t["sampled"]["n"]) for t in results["tasks"]}
    (temperature, n), = sampled
    assert f"temperature {temperature}, {n} samples per prompt" in " ".join(page.split())
    assert f"margin {results['margin']}" in page



def flat() -> str:
    return " ".join(PAGE.read_text().split())


def test_the_recipes_settings_and_the_load_are_the_files() -> None:
    results = json.loads(RESULTS.read_text())
    settings = {json.dumps(t["settings"], sort_keys=True, default=str) for t in results["tasks"]}
    shared = {k: v for k, v in results["tasks"][0]["settings"].items() if k not in ("data", "data_options")}
    assert all(t["overrides"] == [] for t in results["tasks"]) and len(settings) == len(results["tasks"])
    lr = results["tasks"][0]["roles"]["actor"]["options"]["engine"]["optim"]["lr"]
    assert (f"{shared['steps']} steps of {shared['prompts_per_step']} prompts × {shared['n']} samples at temperature "
            f"{shared['temperature']}, {shared['max_new_tokens']} new tokens, lr {lr:.0e}".replace("e-0", "e-")) in flat()
    loads = [x["load_avg"][0] for t in results["tasks"] for x in t["load"].values()]
    assert f"load {min(loads):.0f}–{max(loads):.0f} from other work" in flat()


def task_of(path: Path, name: str) -> dict[str, Any]:
    return next(t for t in json.loads(path.read_text())["tasks"] if t["task"] == name)


def test_the_tasks_not_counted_as_learnt_are_their_files() -> None:
    letters, legs = task_of(LETTERS, "letter_counting"), task_of(LEGS, "leg_counting")
    assert f"greedy {_pair(letters, 'greedy')} and sampled {_pair(letters, 'sampled')}, but 84 of its" in flat()
    assert f"greedy {_pair(legs, 'greedy')} and sampled {_pair(legs, 'sampled')}, exactly the share" in flat()
    assert legs["after"]["greedy"] == legs["constant_answer"]["share"] and legs["constant_answer"]["answer"] == "12"
    assert json.loads(LEGS.read_text())["passed"] is False


def test_the_screening_is_its_file() -> None:
    screening = json.loads(SCREENING.read_text())
    chain = next(c for c in screening["candidates"] if c["data"] == "reasoning_gym:chain_sum")
    assert chain["data_options"]["system_prompt"] == "direct" and chain["val_prompts"] == 100
    assert len(screening["candidates"]) == 7 and all(c["val/accuracy"] == 0.0 for c in screening["candidates"])
    assert "scores nothing (0 of 100 held-out rows on `chain_sum`, nor on six other candidate tasks" in flat()
    first = screening["first_chain_sum_attempt_at_temperature_1"]
    seen = first["samples_per_step"] * len(first["train_reward_max_per_step"])
    assert max(first["train_reward_max_per_step"]) == 0.0 and f"none of the first {seen} `chain_sum` samples was right" in flat()


def test_the_most_common_answer_of_letter_counting() -> None:
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install -e '.[envs]')")
    from hfrt.bench.recipes.gym_recipe import constant_answer

    constant = constant_answer(ROOT / "bench" / "recipes" / "smollm2-gym-letter_counting.toml")
    assert constant == {"answer": "1", "share": 0.84}
    assert "84 of its 100 held-out answers are `1`, and 0.84 is what answering `1` every time scores" in flat()


if __name__ == "__main__":
    print("\n".join(rows(json.loads(RESULTS.read_text()))))
