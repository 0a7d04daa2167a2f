"""What a reward function may declare (roles/reward_inputs.py): the check of its parameters before
launch, the response's token ids / length made from the rollout's tensor columns, and the reward
role's read-only `settings` — down to the scores a reward daemon (in this process) gives.
The table on docs/roles-and-losses.md ("What a reward function may declare") lists the same names.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.daemon.base import DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.check import problems
from hfrt.roles.reward import RewardDaemon
from hfrt.roles.reward_fns import REGISTRY, RewardFunctionError
from hfrt.roles.reward_inputs import (
    POSITIONAL,
    ROW_FIELDS,
    SETTINGS_FIELD,
    TOKEN_FIELDS,
    check_declared,
    check_settings,
    may_declare,
    own_fields,
    response_tokens,
)
from tests.docs.snippets import ROOT

PENALTY = '''
def score(response, ground_truth, response_ids, response_length, settings, prompt=""):
    assert len(response_ids) == response_length
    return float(min(0, settings["max_len"] - response_length))
'''


def test_a_function_may_declare_row_fields_token_fields_and_settings() -> None:
    def full(response: str, truth: Any, prompt: str, data_source: str, extra_info: dict[str, Any], uid: str,
             response_ids: list[int], response_length: int, settings: Any) -> float:
        return 0.0

    def anything(answer: str, gold: Any, **info: Any) -> float:
        return 0.0

    for fn in (full, anything, *REGISTRY.values()):
        check_declared(fn, fn.__name__)  # accepted: no error
    assert may_declare() == ["prompt", "data_source", "extra_info", "uid", "response_ids", "response_length", "settings"]


def test_an_unknown_declared_name_is_refused_naming_the_function_the_name_and_what_may_be_declared() -> None:
    def typo(response: str, ground_truth: Any, respons_length: int = 0) -> float:
        return 0.0

    with pytest.raises(RewardFunctionError) as caught:
        check_declared(typo, "'my.py:typo'")
    message = str(caught.value)
    assert message.startswith("reward function 'my.py:typo' declares parameter 'respons_length' (did you mean 'response_length'?)")
    assert "may declare prompt, data_source, extra_info, uid, response_ids, response_length, settings" in message
    assert "row_fields" in message and "**info" in message

    def flow_column(response: str, ground_truth: Any, *, difficulty: float) -> float:
        return difficulty

    with pytest.raises(RewardFunctionError, match="declares parameter 'difficulty'"):
        check_declared(flow_column, "f")
    check_declared(flow_column, "f", row_fields=["difficulty"])  # a column the flow names is accepted


def test_the_role_check_refuses_before_launch(tmp_path: Path) -> None:
    """What `hfrt controller` runs before starting any daemon (hfrt.roles.check)."""
    (tmp_path / "r.py").write_text("def score(response, ground_truth, max_len):\n    return 0.0\n" + PENALTY.replace("def score", "def good"))
    spec = f"{tmp_path / 'r.py'}"
    roles = {
        "reward": {"impl": "reward", "options": {"function": f"{spec}:score"}},
        "good": {"impl": "reward", "options": {"function": f"{spec}:good", "settings": {"max_len": 3}}},
        "table": {"impl": "reward", "options": {"function": f"{spec}:good", "settings": 12}},
        "fields": {"impl": "reward", "options": {"function": f"{spec}:good", "row_fields": ["response_ids"]}},
    }
    found = problems(roles)
    assert len(found) == 3, found
    assert found[0].startswith(f"roles.reward: reward function '{spec}:score' declares parameter 'max_len'")
    assert found[1].startswith("roles.table: option settings=12 must be a table")
    assert found[2] == "roles.fields: option row_fields: ['response_ids'] are given by the reward role itself, not row fields"


def test_response_tokens_come_from_attention_without_padding() -> None:
    tensors = {
        "responses": torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]),  # [prompt 2 | response 4]
        "response_mask": torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]),  # 0 on a tool output (token 6)
    }
    assert response_tokens(tensors, "w") == [[5, 6, 7], [8], []]  # attention covers tool outputs
    del tensors["attention_mask"]
    assert response_tokens(tensors, "w") == [[5, 7], [8], []]  # no attention mask: the response mask
    rows = own_fields({"response_ids", "response_length", "settings"}, tensors, check_settings({"a": 1}), 3, "w", optional=False)
    assert [r["response_length"] for r in rows] == [2, 1, 0] and rows[0]["settings"]["a"] == 1
    with pytest.raises(KeyError, match=re.escape("w: the reward function declares response_ids / response_length, which need the tensor column 'responses'")):
        own_fields({"response_length"}, {"response_mask": tensors["response_mask"]}, {}, 3, "w", optional=False)
    assert own_fields({"response_ids"}, {}, {}, 2, "w", optional=True) == [{}, {}]  # **info: left out


def test_settings_are_read_only_all_the_way_down() -> None:
    settings = check_settings({"max_len": 12, "words": ["a"], "nested": {"x": 1}})
    assert settings["max_len"] == 12 and settings["words"] == ("a",) and settings["nested"]["x"] == 1
    with pytest.raises(TypeError):
        settings["max_len"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        settings["nested"]["x"] = 2  # type: ignore[index]


@pytest.fixture
def global_torch_state() -> Iterator[None]:
    """A reward daemon's setup sets torch's threads and seeds: put them back afterwards."""
    threads, rng, py_rng = torch.get_num_threads(), torch.get_rng_state(), random.getstate()
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    random.setstate(py_rng)


def test_a_reward_daemon_scores_with_token_length_and_settings(tmp_path: Path, global_torch_state: None) -> None:
    (tmp_path / "penalty.py").write_text(PENALTY)
    options = {"function": f"{tmp_path / 'penalty.py'}:score", "settings": {"max_len": 2}}
    daemon = RewardDaemon(DaemonContext("reward", options=options))
    asyncio.run(daemon.setup())
    batch = Batch(
        {"responses": torch.tensor([[5, 6, 7, 9], [8, 0, 0, 0]]), "response_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])},
        {"response": ["abcd", "e"], "ground_truth": ["", ""], "prompt": ["p", "q"]},
    )
    out = daemon.score(batch)
    assert out.non_tensor["score"] == [-2.0, 0.0]  # 4 tokens against max_len 2; 1 token within it
    assert out.tensors["token_level_scores"][0, 3] == -2.0


def test_the_docs_table_lists_exactly_what_may_be_declared() -> None:
    """docs/roles-and-losses.md's table "What a reward function may declare": name and type of each."""
    page = (ROOT / "docs" / "roles-and-losses.md").read_text()
    table = page.split("#### What a reward function may declare", 1)[1].split("\n\n", 2)[1]
    rows = [re.split(r"(?<!\\)\|", line)[1:3] for line in table.splitlines() if line.startswith("| `")]  # a `\|` inside a cell is text
    listed = {name.strip().strip("`"): kind.strip().strip("`").replace("\\|", "|") for name, kind in rows}
    fields = {**POSITIONAL, **ROW_FIELDS, **TOKEN_FIELDS, **SETTINGS_FIELD}
    assert listed == {name: kind for name, (kind, _) in fields.items()}
