"""Reward-model folders in process: a value model exported as *ForSequenceClassification loads in
transformers with the same scores, loads back as a value model, and a tiny random HF
sequence-classification model built here loads too; a plain LM folder is refused as a reward
model; score pooling and running moments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfrt.roles.models import (
    ModelConfig,
    ModelLoadError,
    check_reward_model_dir,
    export_sequence_classifier,
    load_model,
    load_tokenizer,
    materialize,
)
from hfrt.roles.reward_scores import RunningMoments, normalized, pool_scores


def _last_scores(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions)[:, -1]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tok = load_tokenizer("tiny")
    enc = tok(["1+2=3", "2+2=44 and more"], padding=True, return_tensors="pt")  # left-padded
    return enc["input_ids"], enc["attention_mask"]


def test_export_loads_as_sequence_classifier_and_back(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model = load_model(ModelConfig("tiny", value_head=True, seed=3)).eval()
    torch.nn.init.normal_(model.value_head.weight, std=0.5)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    folder = export_sequence_classifier(materialize("tiny"), weights, tmp_path / "rm", {"mean": 0.5, "std": 2.0})
    ids, mask = _batch()
    expected = _last_scores(model, ids, mask)

    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert hf.config.num_labels == 1 and hf.config.mean == 0.5
    with torch.no_grad():
        got = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)

    again = load_model(ModelConfig(str(folder), value_head=True, seed=99)).eval()  # head from the folder, not the seed
    assert torch.allclose(_last_scores(again, ids, mask), expected, atol=1e-5)
    check_reward_model_dir(str(folder))
    assert (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()


def test_a_random_hf_sequence_classifier_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    tok = load_tokenizer("tiny")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    hf = AutoModelForSequenceClassification.from_config(config).eval()
    hf.save_pretrained(tmp_path / "seqcls")
    tok.save_pretrained(tmp_path / "seqcls")
    check_reward_model_dir(str(tmp_path / "seqcls"))
    ids, mask = _batch()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    ours = load_model(ModelConfig(str(tmp_path / "seqcls"), value_head=True)).eval()
    assert torch.allclose(_last_scores(ours, ids, mask), expected, atol=1e-5)


def test_a_plain_language_model_is_not_a_reward_model() -> None:
    with pytest.raises(ModelLoadError, match="no score head") as info:
        check_reward_model_dir(str(materialize("tiny")))
    assert str(materialize("tiny")) in str(info.value)
    check_reward_model_dir("tiny")  # a preset: its seeded random head is allowed (tests use it)


def test_pool_scores_and_running_moments() -> None:
    shifted = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])  # column j: after j response tokens
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert pool_scores(shifted, mask, "last").tolist() == [3.0, 5.0]
    assert pool_scores(shifted, mask, "mean").tolist() == [2.5, 5.0]
    moments = RunningMoments()
    data = torch.arange(10.0)
    moments.update(data[:3])
    moments.update(data[3:])
    assert moments.mean == pytest.approx(4.5) and moments.std == pytest.approx(float(data.std(unbiased=False)))
    assert normalized(torch.tensor([4.5, 100.0]), moments.mean, moments.std, 2.0).tolist() == [0.0, 2.0]
