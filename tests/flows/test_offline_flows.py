"""The sft and dpo flows' settings and data, checked before any daemon starts (no torch, no daemon):
SFT rows in TRL's two formats and the errors naming a bad row, the addition task's demonstrations,
unknown keys and bad loss options named, the held-out split seeded, and DPO's reference role
dropped for a LoRA actor (the actor stands in for it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows import load_flow
from hfrt.flows.recipes.dpo import DPOConfig
from hfrt.flows.recipes.sft import SFTConfig
from hfrt.flows.sft_data import SFTDataError, addition_demonstrations, check_sft_row, read_sft_rows, sft_columns

CHAT = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]


def write(tmp_path: Path, rows: list[Any], name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_both_sft_formats_are_read_and_numbered(tmp_path: Path) -> None:
    path = write(tmp_path, [{"messages": CHAT}, {"prompt": "1+1=", "response": "2"},
                            {"prompt": CHAT[:1], "completion": CHAT[1:], "extra": 1}])
    rows = read_sft_rows(path)
    assert rows == [{"messages": CHAT, "row": 1}, {"prompt": "1+1=", "completion": "2", "row": 2},
                    {"prompt": CHAT[:1], "completion": CHAT[1:], "row": 3}]
    cols = sft_columns(rows)
    assert cols["messages"] == [CHAT, None, None] and cols["completion"] == [None, "2", CHAT[1:]] and cols["row"] == [1, 2, 3]


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "1+1="}, r"an SFT row has `messages`, or `prompt` and `completion` \(or `response`\); it has \['prompt'\]"),
    ({"prompt": "1+1=", "completion": "2", "response": "2"}, "both `completion` and `response`: give one"),
    ({"prompt": " ", "completion": "2"}, "`prompt` is empty"),
    ({"prompt": "1+1=", "completion": CHAT[1:]}, "`prompt` and `completion` must both be text or both be lists"),
    ({"prompt": CHAT[:1], "completion": CHAT}, r"a chat `completion` holds the assistant's message\(s\) only"),
    ({"messages": CHAT[:1]}, r"the conversation has no assistant message to train on \(roles \['user'\]\)"),
    ({"messages": "hi"}, "`messages` must be a list of"),
    ("text", "a row must be an object"),
])
def test_a_bad_sft_row_is_named(row: Any, message: str) -> None:
    with pytest.raises(SFTDataError, match=r"rows.jsonl: row 4: " + message):
        check_sft_row(row, "rows.jsonl: row 4")


def test_the_sft_config_refuses_a_bad_file_naming_the_row_and_reads_the_split(tmp_path: Path) -> None:
    bad = write(tmp_path, [{"prompt": "a", "completion": "b"}, {"messages": CHAT[:1]}])
    with pytest.raises(ValueError, match=r"config data: .*rows.jsonl: row 2: the conversation has no assistant"):
        SFTConfig.read({"data": str(bad)})
    cfg = SFTConfig.read({"rows_count": 50, "seed": 3})
    train, val = cfg.rows()
    assert (len(train), len(val)) == (45, 5) and cfg.rows() == (train, val)
    assert cfg.steps_for(len(train)) == 2 and SFTConfig.read({"max_steps": 1}).steps_for(1000) == 1
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['row_per_step'\] \(did you mean `rows_per_step`\?\)"):
        SFTConfig.read({"row_per_step": 4})
    with pytest.raises(ValueError, match=r"config max_length=1: must be at least 2 tokens"):
        SFTConfig.read({"max_length": 1})
    assert SFTConfig.read({}).truncation == "right" and SFTConfig.read({"truncation": "error"}).truncation == "error"
    with pytest.raises(ValueError, match=r"config truncation='left': use one of right, error"):
        SFTConfig.read({"truncation": "left"})


def test_addition_demonstrations_answer_their_prompts() -> None:
    rows = addition_demonstrations(20, seed=0, max_operand=2)
    assert all(int(r["prompt"][0]) + int(r["prompt"][2]) == int(r["completion"]) for r in rows)
    assert [r["row"] for r in rows] == list(range(1, 21))


def test_dpo_loss_options_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"config: dpo: option loss_type='kto': use one of sigmoid, ipo, hinge, robust"):
        DPOConfig.read({"loss_type": "kto"})
    with pytest.raises(ValueError, match=r"label_smoothing=0.2: loss_type='ipo' takes none"):
        DPOConfig.read({"loss_type": "ipo", "label_smoothing": 0.2})
    with pytest.raises(ValueError, match=r"option beta=0.0: must be > 0"):
        DPOConfig.read({"beta": 0})
    assert DPOConfig.read({"loss_type": "robust", "label_smoothing": 0.1, "beta": 1}).loss_options() == {
        "loss_type": "robust", "beta": 1.0, "label_smoothing": 0.1}


def test_dpo_reads_the_rm_flows_pair_file(tmp_path: Path) -> None:
    path = write(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 9 + [{"prompt": "1+1=", "chosen": "2"}])
    with pytest.raises(ValueError, match=r"config data: .*rows.jsonl: row 10: missing column\(s\) \['rejected'\]"):
        DPOConfig.read({"data": str(path)})


def test_a_lora_actor_stands_in_for_dpos_reference() -> None:
    flow = load_flow("dpo")
    lora = {**flow.roles, "actor": {**flow.roles["actor"], "options": {**flow.roles["actor"]["options"], "lora": {"rank": 8}}}}
    assert set(flow.roles_for({}, flow.roles)) == {"actor", "reference"}
    assert set(flow.roles_for({}, lora)) == {"actor"}
    assert set(flow.roles_for({"reference_from_actor": False}, lora)) == {"actor", "reference"}


def test_the_documented_defaults_and_config_hold(tmp_path: Path) -> None:
    """docs/pipeline.md: the sft flow's default run is 57 steps over 2000 demonstrations, the dpo
    flow's 113 over 4000 pairs, and its sft.toml is a valid configuration (its data file aside)."""
    from hfrt import config as runconfig
    from tests.docs.snippets import ROOT, blocks

    sft, dpo = SFTConfig.read({}), DPOConfig.read({})
    assert sft.steps_for(len(sft.rows()[0])) == 57 and sft.rows_count == 2000
    assert dpo.steps_for(len(dpo.rows()[0])) == 113 and dpo.pairs_count == 4000
    block = next(b for b in blocks(ROOT / "docs" / "pipeline.md") if b.lang == "toml" and "sft.toml" in b.text)
    (tmp_path / "sft.toml").write_text(block.text)
    flow = load_flow("sft")
    rc = runconfig.build(flow.roles, file=tmp_path / "sft.toml")
    assert rc.flow["data"] == "chats.jsonl" and rc.roles["actor"]["options"]["model"] == "smollm2-135m"
    flow.check({k: v for k, v in rc.flow.items() if k != "data"})
    runconfig.check_role_options(rc.roles)
