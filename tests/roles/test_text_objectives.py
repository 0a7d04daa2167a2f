"""Tokenising training text and the supervised / preference objectives on a local engine (no
daemon): a conversation's assistant turns are what the loss counts (headers and other turns are
context), a template that does not render a conversation's prefixes as its prefixes and rows of
the wrong shape or length are refused naming the row, a token budget packing SFT rows or keeping
pairs whole leaves the losses unchanged, and the reference's pair log-probs are the sums of its
per-token log-probs. TRL parity: tests/roles/test_trl_parity.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.losses.preference import preference_loss
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
from hfrt.roles.rows import merge
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.sequences import RowError, conversation_row, sft_row, truncate_right
from hfrt.roles.training.text_objectives import TextTraining, pair_log_probs, pair_tensors
from hfrt.wire.loss_options import PreferenceLoss, check_preference_options

TOK = load_tokenizer("tiny")
PAIRS = {"prompt": ["3+4=", "1+1=", "2+2=", "10+10="], "chosen": ["7", "2", "4 ok", "20"],
         "rejected": ["8", "x1", "5", "no idea at all"], "row": [1, 2, 3, 4]}


def engine(**settings: Any) -> Any:
    torch.manual_seed(0)
    return build_train_engine(load_model(ModelConfig("tiny")), EngineConfig(optim=OptimConfig(lr=1e-3), **settings))


def text(ids: list[int]) -> str:
    return str(TOK.decode(ids))


def test_a_conversation_counts_its_assistant_turns_only() -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}]
    row = conversation_row(TOK, chat, "row 1")
    assert text(row.prompt) == "<user>hi\n<assistant>"
    counted = [t for t, m in zip(row.completion, row.loss_mask, strict=True) if m]
    assert text(counted) == "yo\nok\n"  # each turn's content and its end; the tool output and headers are context
    assert text(row.completion) == "yo\n<tool>42\n<assistant>ok\n<user>bye\n"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row() -> None:
    tok = copy.deepcopy(TOK)  # renders only the last message: earlier turns vanish once another follows
    tok.chat_template = "<{{ messages[-1].role }}>{{ messages[-1].content }}{% if add_generation_prompt %}<assistant>{% endif %}"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]
    with pytest.raises(RowError, match=r"data row 7: the chat template renders messages\[:\d\] without the earlier"):
        conversation_row(tok, chat, "data row 7")


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "1+1="}, r"row 3: an SFT row has `messages`, or `prompt` and `completion`"),
    ({"prompt": "1+1=", "completion": [{"role": "assistant", "content": "2"}]}, r"row 3: prompt and completion must both be text or both"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"row 3: the conversation has no assistant message"),
    ({"prompt": "", "completion": "2"}, r"row 3: the prompt is empty"),
])
def test_rows_of_the_wrong_shape_are_refused_naming_the_row(row: dict[str, Any], message: str) -> None:
    with pytest.raises(RowError, match=message):
        sft_row(TOK, row, "row 3")


def test_text_completions_end_with_eos_once_and_response_is_a_completion() -> None:
    a = sft_row(TOK, {"prompt": "1+1=", "response": "2"}, "r")
    b = sft_row(TOK, {"prompt": "1+1=", "completion": "2</s>"}, "r")
    assert a == b and a.completion == [TOK.convert_tokens_to_ids("2"), TOK.eos_token_id]


def test_a_row_over_max_length_is_refused_naming_it() -> None:
    batch = Batch({}, {"prompt": ["1+1=", "2+2="], "completion": ["2", "4 is the answer"], "row": [11, 12]})
    with pytest.raises(RowError, match=r"actor.sft_update: data row 12: 20 tokens, over max_length 12"):
        TextTraining(engine(), TOK, "actor").sft_update(batch, max_length=12)


def test_truncation_right_keeps_a_long_rows_first_max_length_tokens_and_counts_it() -> None:
    """TRL's truncation_mode="keep_start": the row's first max_length tokens are trained on, the
    rest dropped; sft/truncated_rows and val/truncated_rows count the rows cut."""
    rows = {"prompt": ["1+1=", "2+2="], "completion": ["2", "4 is the answer"], "row": [11, 12]}
    short, long = (sft_row(TOK, {"prompt": p, "completion": c}, "r") for p, c in zip(rows["prompt"], rows["completion"], strict=True))
    assert len(long) == 20 and len(short) <= 12
    cut = truncate_right(long, 12)
    assert len(cut) == 12 and cut.prompt == long.prompt and cut.completion == long.completion[: 12 - len(long.prompt)]
    training = TextTraining(engine(), TOK, "actor")
    got = training.sft_evaluate(Batch({}, rows), max_length=12, truncation="right")
    want = training.sft_evaluate(Batch({}, {"prompt": ["1+1=", "2+2="], "completion": ["2", text(cut.completion)], "row": [11, 12]}))
    assert got["val/truncated_rows"] == 1.0 and want["val/truncated_rows"] == 0.0
    assert got["val/tokens"] == len(short.completion) + len(cut.completion) == want["val/tokens"] - 1  # the cut row lost its EOS
    update = training.sft_update(Batch({}, rows), max_length=12, truncation="right")
    assert update["sft/truncated_rows"] == 1.0 and update["sft/tokens"] == got["val/tokens"]
    # a prompt that alone fills max_length keeps one completion token that weighs nothing (TRL drops the row)
    assert truncate_right(long, len(long.prompt)).loss_mask == [0]
    with pytest.raises(ValueError, match=r"actor.sft_update: truncation='left': use one of right, error"):
        training.sft_update(Batch({}, rows), max_length=12, truncation="left")


def test_packing_sft_rows_under_a_token_budget_leaves_the_loss_unchanged() -> None:
    batch = Batch({}, {"prompt": ["3+4=", "1+1=", "12+30=", "0+0="], "completion": ["7", "2", "42 is it", "0"]})
    plain = TextTraining(engine(micro_batch_size=4), TOK, "actor")
    packed = TextTraining(engine(max_tokens_per_micro_batch=16, pack=True), TOK, "actor")
    for _ in range(2):
        a, b = plain.sft_update(batch), packed.sft_update(batch)
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], abs=1e-5)
        assert a["sft/token_accuracy"] == pytest.approx(b["sft/token_accuracy"], abs=1e-6)


def test_pair_log_probs_are_the_sums_of_the_token_log_probs() -> None:
    ref = engine(trainable=False)
    batch = Batch({}, PAIRS)
    sums = pair_log_probs(ref, TOK, batch, "reference")
    tensors = pair_tensors(TOK, batch, None, "reference")
    per_token = ref.forward({k: v for k, v in tensors.items() if k != "pair_weight"}).log_probs
    want = (per_token * tensors["response_mask"]).sum(-1).reshape(-1, 2)
    assert torch.allclose(sums.tensors["ref_chosen_logps"], want[:, 0]) and torch.allclose(sums.tensors["ref_rejected_logps"], want[:, 1])


def test_a_token_budget_never_splits_a_pair() -> None:
    """With a budget that fits about one sequence, each micro-batch still holds whole pairs (rows
    2i, 2i + 1): the loss and its step equal those of one micro-batch for all pairs."""
    batch = Batch({}, PAIRS)
    ref = pair_log_probs(engine(trainable=False), TOK, batch, "reference")
    cfg = PreferenceLoss("sigmoid", 0.5)
    whole = TextTraining(engine(micro_batch_size=8), TOK, "actor")
    tight = TextTraining(engine(max_tokens_per_micro_batch=12), TOK, "actor")
    for _ in range(2):
        a, b = whole.dpo_update(merge(batch, [ref]), cfg), tight.dpo_update(merge(batch, [ref]), cfg)
        assert a["dpo/loss"] == pytest.approx(b["dpo/loss"], abs=1e-6) and a["dpo/pairs"] == b["dpo/pairs"] == 4
    assert tight.engine.rows_together == 1  # restored after the call


def test_the_update_needs_the_references_columns() -> None:
    with pytest.raises(KeyError, match=r"needs the reference's columns \['ref_chosen_logps', 'ref_rejected_logps'\]"):
        TextTraining(engine(), TOK, "actor").dpo_update(Batch({}, PAIRS), PreferenceLoss())


def test_ipo_needs_token_counts_and_options_are_checked_by_name() -> None:
    one = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="averages each side's log-ratio over its tokens"):
        preference_loss(one, one, one, one, PreferenceLoss("ipo"))
    with pytest.raises(ValueError, match=r"dpo: option loss_type='kto': use one of sigmoid, ipo, hinge, robust"):
        check_preference_options({"loss_type": "kto"})
    with pytest.raises(ValueError, match=r"label_smoothing=0.1: loss_type='hinge' takes none"):
        check_preference_options({"loss_type": "hinge", "label_smoothing": 0.1})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['betta'\]"):
        check_preference_options({"betta": 0.1})
