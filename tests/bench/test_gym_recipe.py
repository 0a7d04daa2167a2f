"""The reasoning-gym recipe check (bench/recipes/gym_recipe.py) end to end on the tiny preset: the
sampled pass of the starting weights (val_only, val_temperature, val_n) on kept daemons, two GRPO
steps attached to them with greedy validation before and after, the sampled pass of the trained
weights, the daemons stopped, and the JSON the figure is read from; the margin decides the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install -e '.[envs]')")

from hfrt.bench.recipes.gym_recipe import failures, main  # noqa: E402

TINY = """
data = "reasoning_gym:chain_sum"
steps = 2
val_every = 2
val_prompts = 6
prompts_per_step = 2
n = 2
max_new_tokens = 4
export_hf = false
tensorboard = false
[data_options]
size = 20
min_terms = 2
max_terms = 2
max_digits = 1
system_prompt = "direct"
[roles.reward.options]
function = "reasoning_gym"
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_recipe_measures_before_and_after_greedy_and_sampled_on_the_same_rows(tmp_path: Path) -> None:
    config, out = tmp_path / "tiny-gym.toml", tmp_path / "gym.json"
    config.write_text(TINY)
    code = main(["--config", str(config), "--work", str(tmp_path / "work"), "--out", str(out),
                 "--val-temperature", "1.0", "--val-n", "3", "--margin", "-1", "--no-constant-check"])
    assert code == 0
    result = json.loads(out.read_text())
    (figure,) = result["tasks"]
    assert figure["task"] == "chain_sum" and figure["val_prompts"] == 6 and figure["sampled"] == {"temperature": 1.0, "n": 3}
    for when in ("before", "after"):
        assert set(figure[when]) == {"greedy", "sampled"} and all(0.0 <= v <= 1.0 for v in figure[when].values())
    assert figure["steps"] == 2 and len(figure["train_reward_mean"]) == 2
    assert [v["step"] for v in figure["greedy_validation"]] == [-1, 1]
    assert figure["settings"]["data_options"]["max_digits"] == 1 and set(figure["wall_s"]) == {"before_sampled", "train", "after_sampled"}
    assert "load average" in figure["load"]["train_end"]["uptime"] and result["passed"] is True
    work = tmp_path / "work" / "chain_sum"
    before = json.loads((work / "before" / "metrics.jsonl").read_text().splitlines()[0])
    assert before["step"] == 0 and before["val/accuracy"] == figure["before"]["sampled"]
    assert not list((work / "train").glob("attach.json"))  # the training run attached to the kept daemons
    assert len(failures(result, 2.0, constant_check=False)) == 2  # no gain of 2: greedy and sampled both fail
    assert set(figure["constant_answer"]) == {"answer", "share"} and 0 < figure["constant_answer"]["share"] <= 1
    beaten = dict(figure, after={"greedy": figure["constant_answer"]["share"], "sampled": 1.0}, before={"greedy": 0.0, "sampled": 0.0})
    assert failures({"tasks": [beaten]}, 0.05) == [  # as good as always giving the most common answer: not learnt
        f"chain_sum greedy: {beaten['after']['greedy']:.3f} is no better than always answering "
        f"{figure['constant_answer']['answer']!r} ({figure['constant_answer']['share']:.3f})"]
