"""Function-based rewards: the rule registry, user functions by spec, clear errors, token placement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfrt.roles.reward_fns import RewardFunctionError, resolve, score_all, token_level_rewards


def test_rule_functions() -> None:
    assert resolve("exact_match")("The answer is \\boxed{Paris}.", "paris") == 1.0
    assert resolve("exact_match")("Lyon", "paris") == 0.0
    numeric = resolve("numeric_match")
    assert numeric("so 12 + 30 = 42\n#### 42", "42") == 1.0
    assert numeric("it costs 1,250.0 dollars", 1250) == 1.0
    assert numeric("no number here", "3") == 0.0
    fmt = resolve("format")
    assert fmt("<think>add</think> <answer>4</answer>", None) == 1.0
    assert fmt("4", None) == 0.0


def test_user_function_from_module_and_from_file(tmp_path: Path) -> None:
    assert resolve("hfrt.roles.reward_fns:numeric_match")("7", "7") == 1.0
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def length_bonus(response, ground_truth, prompt=''):\n    return len(response) / 10 + len(prompt)\n"
    )
    fn = resolve(f"{path}:length_bonus")
    scores = score_all(fn, ["abcd", "ab"], [None, None], [{"prompt": "x", "unused": 1}, {"prompt": ""}])
    assert scores == pytest.approx([1.4, 0.2])  # only the info fields it declares are passed


def test_bad_specs_name_what_failed(tmp_path: Path) -> None:
    with pytest.raises(RewardFunctionError, match="unknown reward function 'nope'"):
        resolve("nope")
    with pytest.raises(RewardFunctionError, match="does not exist"):
        resolve(f"{tmp_path}/missing.py:f")
    with pytest.raises(RewardFunctionError, match="no function 'absent'"):
        resolve("hfrt.roles.reward_fns:absent")
    with pytest.raises(RewardFunctionError, match="cannot import"):
        resolve("no_such_package_xyz:f")


def test_a_raising_function_names_itself_and_the_sample(tmp_path: Path) -> None:
    path = tmp_path / "bad_reward.py"
    path.write_text(
        "def judge(response, ground_truth):\n    if response == 'boom':\n        raise KeyError('label')\n    return 1.0\n"
    )
    fn = resolve(f"{path}:judge")
    with pytest.raises(RewardFunctionError, match=r"judge raised on sample 1: KeyError"):
        score_all(fn, ["fine", "boom"], [0, 0])
    with pytest.raises(RewardFunctionError, match="not a finite number"):
        score_all(lambda r, g: float("nan"), ["x"], [0], name="nan_fn")


def test_scores_go_on_the_last_response_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    rewards = token_level_rewards([2.0, -1.0, 5.0], mask)
    assert rewards.tolist() == [[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0]]


def test_a_bad_sample_can_score_error_score_instead_of_failing() -> None:
    def fn(response: str, ground_truth: object) -> float:
        return 1.0 / len(response)  # raises on the empty response

    errors: list[str] = []
    scores = score_all(fn, ["ab", "", "abcd"], [0, 0, 0], name="inverse", error_score=-1.0, errors=errors)
    assert scores == [0.5, -1.0, 0.25]
    assert errors[0] == "" and errors[2] == ""
    assert "inverse raised on sample 1: ZeroDivisionError" in errors[1]
    with pytest.raises(RewardFunctionError, match="sample 1"):
        score_all(fn, ["ab", ""], [0, 0], name="inverse")
