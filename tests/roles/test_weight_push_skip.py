"""The hybrid engine pushes weights only when they changed since the generation engine's copy:
an engine that keeps its weights through sleep (vLLM on CPU) is not pushed the same optimizer step
twice; an optimizer step or a checkpoint load (forget_push) makes the next transition push."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
from hfrt.roles.generation.hybrid import HybridEngine
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

from .dist_workers import make_batch, ppo_loss


class KeepingEngine(HFGenerationEngine):
    """The built-in engine on a private copy whose weights survive sleep (as vLLM's do on CPU),
    counting pushes and whether they came marked stable."""

    keeps_weights_asleep = True  # type: ignore[assignment]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pushes: list[bool] = []

    def sleep(self) -> None:  # keeps the weights
        pass

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False) -> None:
        self.pushes.append(stable)
        super().load_weights(named)


def test_push_skipped_while_the_weights_are_unchanged() -> None:
    tok = load_tokenizer("tiny")
    model = load_model(ModelConfig("tiny"))
    train = build_train_engine(model, EngineConfig(backend="local", optim=OptimConfig(lr=1e-2)))
    gen = KeepingEngine(load_model(ModelConfig("tiny")), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    hybrid = HybridEngine(train, gen)
    prompt = [tok("3+4=")["input_ids"]]
    params = SamplingParams(max_new_tokens=3, n=2, seed=0)

    _, first = hybrid.generate(prompt, params)
    _, again = hybrid.generate(prompt, params)
    assert gen.pushes == [True]  # the local backend's own parameters: no defensive copy
    assert first["reshard/push_skipped"] == 0.0 and again["reshard/push_skipped"] == 1.0
    assert again["reshard/pushed_mb"] == 0.0

    train.step(ppo_loss, make_batch(model.config.vocab_size))
    _, stepped = hybrid.generate(prompt, params)
    assert len(gen.pushes) == 2 and stepped["reshard/push_skipped"] == 0.0
    for name, p in model.named_parameters():  # the pushed copy is the updated weights
        assert torch.equal(gen.local_parameters()[name], p), name

    hybrid.forget_push()
    hybrid.generate(prompt, params)
    assert len(gen.pushes) == 3


def test_an_engine_that_frees_its_weights_is_pushed_every_time() -> None:
    tok = load_tokenizer("tiny")
    train = build_train_engine(load_model(ModelConfig("tiny")), EngineConfig(backend="local"))
    gen = HFGenerationEngine(load_model(ModelConfig("tiny")), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    hybrid = HybridEngine(train, gen)
    for _ in range(2):
        _, metrics = hybrid.generate([tok("1+1=")["input_ids"]], SamplingParams(max_new_tokens=2, seed=0))
        assert metrics["reshard/push_skipped"] == 0.0 and metrics["reshard/pushed_mb"] > 0
