"""The headline figures the docs state that the tiny preset reproduces in about a minute on 2 cores,
each run as its page shows it and asserted with the tolerance the page gives: the README's PPO
quick check, GRPO's reward rising (docs/flows.md), the LoRA example learning (docs/lora.md), and
a run on a data file (docs/configuration.md). The reward-model recipe's figure is asserted in
test_rm_flow.py; slower figures (500-step PPO, agent_calc, PPO on a learned reward) are
bench/recipes/figures.py's. Each page cites the test that guards its figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

QUIET = ("--set", "progress=off", "--set", "tensorboard=false", "--set", "export_hf=false")
#: docs/lora.md's example for the tiny preset: adapters on every linear layer and on the output head
TINY_LORA_TARGETS = '["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj","lm_head"]'


def controller(tmp_path: Path, *args: str, timeout: float = 400) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "hfrt", "controller", "--run-dir", str(tmp_path / "run"), *args, *QUIET],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout[done.stdout.index("{"):]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_ppo_quick_check(tmp_path: Path) -> None:
    """README: `hfrt controller --flow ppo --set steps=2 --set val_every=0` trains two steps and
    prints a JSON summary; no bulk bytes went through the controller."""
    summary = controller(tmp_path, "--flow", "ppo", "--set", "steps=2", "--set", "val_every=0")
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    assert 0.0 <= summary["reward_first"] <= 1.0 and "val_accuracy_last" not in summary


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_grpo_reward_rises(tmp_path: Path) -> None:
    """docs/flows.md: `--flow grpo --set n=8 --set steps=100` takes the mean reward from about 0.02
    in the first quarter of its steps to about 0.75 in the last; asserted: below 0.1, then at least 0.5."""
    summary = controller(tmp_path, "--flow", "grpo", "--set", "n=8", "--set", "steps=100")
    assert summary["reward_first_quarter"] < 0.1, summary
    assert summary["reward_last_quarter"] >= 0.5, summary


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_lora_example_learns(tmp_path: Path) -> None:
    """docs/lora.md: GRPO with rank-16 adapters on every linear layer and the output head of the
    tiny preset takes the reward from about 0.015 to about 0.5 in 100 steps; asserted: below 0.1,
    then at least 0.3. Adapters on the blocks alone stay near 0.015 (the page says why)."""
    summary = controller(tmp_path, "--flow", "grpo", "--set", "steps=100", "--set", "roles.actor.options.lora.rank=16",
                         "--set", f"roles.actor.options.lora.target_modules={TINY_LORA_TARGETS}")
    assert summary["reward_first_quarter"] < 0.1, summary
    assert summary["reward_last_quarter"] >= 0.3, summary


ROOT = Path(__file__).resolve().parents[2]
#: page → (the figures it states, the test that asserts them): a page and its test cite each other
CITED = {
    "docs/flows.md": (("**0.02**", "**0.75**"), "test_doc_figures.py::test_grpo_reward_rises"),
    "docs/lora.md": (("**0.015**", "**0.49**"), "test_doc_figures.py::test_lora_example_learns"),
    "docs/reward-models.md": (("0.994",), "test_rm_flow.py::test_the_documented_recipe_reaches_its_held_out_accuracy"),
}


@pytest.mark.parametrize("page", sorted(CITED))
def test_each_page_states_its_figures_and_names_their_test(page: str) -> None:
    figures, test = CITED[page]
    text = (ROOT / page).read_text()
    for figure in figures:
        assert figure in text, f"{page} no longer states {figure}: update the page, CITED and the test together"
    assert test in text, f"{page} does not name {test}, which asserts its figures"
    file, name = test.split("::")
    assert f"def {name}(" in (ROOT / "tests/integration" / file).read_text(), f"{test} does not exist"
