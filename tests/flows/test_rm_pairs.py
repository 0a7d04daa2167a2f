"""The rm flow's pair file and config, checked before any daemon starts: every bad row is named
(missing column, empty or identical chosen / rejected, chat response after a text prompt, a bad
margin), the held-out split and the per-step order are seeded, and the recipe's pair generator
prefers what the rule reward prefers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows import load_flow
from hfrt.flows.pairs import PairDataError, addition_pairs, read_pairs, split_pairs, step_rows
from hfrt.flows.recipes.rm import RMConfig
from hfrt.flows.tasks import addition_reward


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "1+2=", "chosen": "3"}, r"row 2: missing column\(s\) \['rejected'\]"),
        ({"prompt": "1+2=", "chosen": "", "rejected": "4"}, "row 2: `chosen` is empty"),
        ({"prompt": "1+2=", "chosen": "3", "rejected": "  "}, "row 2: `rejected` is empty"),
        ({"prompt": "1+2=", "chosen": "3", "rejected": "3"}, "row 2: `chosen` and `rejected` are identical"),
        ({"prompt": "1+2=", "chosen": [{"role": "assistant", "content": "3"}], "rejected": "4"}, "row 2: `chosen` is a chat but `prompt` is text"),
        ({"prompt": "1+2=", "chosen": "3", "rejected": "4", "margin": "big"}, "row 2: `margin` must be a number"),
        ({"prompt": "1+2=", "chosen": 3, "rejected": "4"}, "row 2: `chosen` must be text or a list"),
    ],
)
def test_a_bad_row_is_named(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = write(tmp_path / "pairs.jsonl", [GOOD, row])
    with pytest.raises(PairDataError, match=message) as info:
        read_pairs(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match=message):  # the flow's config check, before launch
        load_flow("rm").check({"data": str(path)})


def test_config_keys_and_values_are_checked(tmp_path: Path) -> None:
    path = write(tmp_path / "pairs.jsonl", [GOOD, GOOD | {"chosen": "3 "}])
    builtin = RMConfig.read({"pairs_count": 50})  # no file: the addition task's rule-labelled pairs
    assert [len(part) for part in builtin.pairs()] == [45, 5]
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['epoch'\] \(did you mean `epochs`\?\)"):
        RMConfig.read({"data": str(path), "epoch": 2})
    with pytest.raises(ValueError, match="config pairs_per_step='8': expected int"):
        RMConfig.read({"data": str(path), "pairs_per_step": "8"})
    cfg = RMConfig.read({"data": str(path), "pairs_per_step": 1, "epochs": 3})
    train, val = cfg.pairs()
    assert (len(train), len(val)) == (1, 1) and cfg.steps_for(len(train)) == 3


def test_split_and_step_order_are_seeded() -> None:
    rows = [{"row": i} for i in range(10)]
    train, val = split_pairs(rows, 0.2, seed=1)
    assert len(val) == 2 and {r["row"] for r in train} | {r["row"] for r in val} == set(range(10))
    assert split_pairs(rows, 0.2, seed=1) == (train, val)
    first_epoch = [r["row"] for s in range(3) for r in step_rows(rows, s, 4, seed=0)][:10]
    assert sorted(first_epoch) == list(range(10))  # one epoch is a permutation, across step boundaries
    assert step_rows(rows, 2, 4, seed=0) == step_rows(rows, 2, 4, seed=0)


def test_recipe_pairs_follow_the_rule() -> None:
    rows = addition_pairs(200, seed=0, max_operand=2, margin=True)
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        truth = str(int(a) + int(b))
        chosen, rejected = (addition_reward(row[k].replace("</s>", ""), truth) for k in ("chosen", "rejected"))
        assert chosen > rejected and row["margin"] == pytest.approx(chosen - rejected)
