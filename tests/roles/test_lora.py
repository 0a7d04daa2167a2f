"""LoRA on the training engines (roles/training/lora.py): only adapters (and a value head) train
and hold optimizer state, adapters off give the base model's log-probs, merged weights compute
what the adapted model does, checkpoints hold adapters + optimizer and resume exactly, the PEFT
adapter folder loads in peft, and bad settings are refused naming what is wrong; FSDP2 and
DeepSpeed with 2 real ranks (a LoRA actor and a LoRA critic) against the one-process LoRA steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hfrt.roles.models import ModelConfig, load_model, resolve_model_dir
from hfrt.roles.training import lora
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.lora import LoraSpec

from .dist_workers import make_batch, ppo_loss, run_ranks
from .lora_workers import lora_step

SPEC = LoraSpec(rank=4, alpha=8.0)


def lora_engine(spec: LoraSpec = SPEC, **engine: object) -> tuple[torch.nn.Module, object]:
    model = load_model(ModelConfig("tiny"))
    config = EngineConfig(backend="local", micro_batch_size=2, optim=OptimConfig(lr=1e-2), **engine)  # type: ignore[arg-type]
    return model, build_train_engine(model, config, spec)


@pytest.mark.slow
def test_only_adapters_train_and_hold_optimizer_state() -> None:
    model, engine = lora_engine()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = make_batch(model.config.vocab_size)
    engine.step(ppo_loss, batch)  # type: ignore[attr-defined]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= {n for n in before if lora.is_adapter(n)}
    assert any(".lora_B." in n for n in changed)  # B starts at 0 and moved
    state = engine.optimizer.state  # type: ignore[attr-defined]
    with_state = {n for n, p in model.named_parameters() if p in state}
    assert with_state == {n for n in before if lora.is_adapter(n)}
    adapters = engine.adapter_state_dict()  # type: ignore[attr-defined]
    assert sorted(adapters) == sorted(n for n in before if lora.is_adapter(n))
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in adapters
    assert lora.saved_name("model.layers.0.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"


@pytest.mark.slow
def test_adapters_off_is_the_base_model_and_merged_weights_are_the_adapted_model() -> None:
    model, engine = lora_engine()
    batch = make_batch(model.config.vocab_size)
    for _ in range(2):
        engine.step(ppo_loss, batch)  # type: ignore[attr-defined]
    base = load_model(ModelConfig("tiny"))
    plain = build_train_engine(base, EngineConfig(backend="local", trainable=False))
    with lora.adapters_disabled(model):
        off = engine.forward_logprobs(batch)  # type: ignore[attr-defined]
    on = engine.forward_logprobs(batch)  # type: ignore[attr-defined]
    mask = batch["response_mask"]
    assert ((off - plain.forward_logprobs(batch)) * mask).abs().max() <= 1e-6
    assert ((on - off) * mask).abs().max() > 1e-4  # the adapters do change the policy
    merged = {k: v for b in engine.state_dict_for_generation() for k, v in b.items()}  # type: ignore[attr-defined]
    assert sorted(merged) == sorted(n for n, _ in base.named_parameters())
    base.load_state_dict(merged)
    assert ((plain.forward_logprobs(batch) - on) * mask).abs().max() < 1e-5


@pytest.mark.slow
def test_checkpoint_holds_adapters_and_optimizer_and_resumes_exactly(tmp_path: Path) -> None:
    model, engine = lora_engine()
    batch = make_batch(model.config.vocab_size)
    engine.step(ppo_loss, batch)  # type: ignore[attr-defined]
    path = engine.save(tmp_path / "ckpt")  # type: ignore[attr-defined]
    saved = torch.load(path / "local.pt", weights_only=True)
    assert set(saved["model"]) == {n for n, _ in model.named_parameters() if lora.is_adapter(n)}
    after = engine.step(ppo_loss, batch)  # type: ignore[attr-defined]
    fresh_model, fresh = lora_engine()
    fresh.load(path)  # type: ignore[attr-defined]
    assert fresh.steps == 1  # type: ignore[attr-defined]
    assert fresh.step(ppo_loss, batch)["loss"] == after["loss"]  # type: ignore[attr-defined]
    for (n, p), (_, q) in zip(model.named_parameters(), fresh_model.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_peft_adapter_folder_loads_in_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    model, engine = lora_engine(spec)
    batch = make_batch(model.config.vocab_size)
    engine.step(ppo_loss, batch)  # type: ignore[attr-defined]
    folder = lora.write_adapter_folder(tmp_path / "adapter", engine.adapter_state_dict(), spec, "tiny")  # type: ignore[attr-defined]
    base = AutoModelForCausalLM.from_pretrained(resolve_model_dir("tiny"))
    loaded = PeftModel.from_pretrained(base, str(folder))
    plain = build_train_engine(loaded, EngineConfig(backend="local", trainable=False))
    diff = (plain.forward_logprobs(batch) - engine.forward_logprobs(batch)) * batch["response_mask"]  # type: ignore[attr-defined]
    assert diff.abs().max() < 1e-5


def test_value_model_adapters_in_backbone_and_head_trains() -> None:
    model = load_model(ModelConfig("tiny", value_head=True))
    engine = build_train_engine(model, EngineConfig(backend="local", optim=OptimConfig(lr=1e-2)), SPEC)
    trains = lora.trainable_names(model)
    assert {"value_head.weight", "value_head.bias"} <= set(trains)
    assert all(lora.is_adapter(n) or n.startswith("value_head.") for n in trains)
    assert any(n.startswith("backbone.layers.0.") for n in trains)
    assert engine.is_value


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"options.lora.rank must be an integer > 0, got 0"):
        LoraSpec.read({"rank": 0}, "options.lora")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['r'\]"):
        LoraSpec.read({"r": 8}, "options.lora")
    assert LoraSpec.read({"rank": 8}, "x") == LoraSpec(8, 16.0, 0.0, "all-linear")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_dir("tiny"))
    with pytest.raises(ValueError, match=r"matches no module.*linear modules are \['down_proj', 'gate_proj', 'k_proj'"):
        lora.counts(config, LoraSpec(4, target_modules=("qkv_proj",)), value_head=False)
    with pytest.raises(ValueError, match="use fsdp2 or deepspeed"):
        lora.check_engine(SPEC, EngineConfig(backend="tp"), "options.lora")


def test_counts_of_smollm2_at_rank_16() -> None:
    """The numbers docs/lora.md quotes: SmolLM2-135M, rank 16, all-linear."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_dir("smollm2-135m"))
    found = lora.counts(config, LoraSpec(16), value_head=False)
    assert found["adapter"] == found["trainable"]
    assert 0.02 < found["adapter"] / found["parameters"] < 0.05, found


def test_the_fit_check_counts_a_frozen_base() -> None:
    """SmolLM2-135M on one rank: full fine-tuning needs weights + grads + AdamW (~2 GiB), LoRA the
    weights and what trains (~0.6 GiB); 1000 MiB passes the second only."""
    from hfrt.daemon.base import DaemonContext
    from hfrt.roles.common import ModelDoesNotFit, ModelOptions, check_fits

    options = {"model": "smollm2-135m", "memory_limit_mb": 1000}
    context = DaemonContext("actor", 0, 1, options=options)
    check_fits(context, ModelOptions.read(options | {"lora": {"rank": 16}}, trainable=True))
    with pytest.raises(ModelDoesNotFit, match=r"needs at least 205\d\.\d MiB"):
        check_fits(context, ModelOptions.read(options, trainable=True))


needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return lora_step(0, 1, out_dir=tmp_path_factory.mktemp("local"), backend="local")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,stage", [("fsdp2", 0), pytest.param("deepspeed", 3, marks=needs_deepspeed)])
def test_two_ranks_train_lora_like_one_process(tmp_path: Path, one_process: dict, backend: str, stage: int) -> None:
    results = run_ranks(lora_step, 2, tmp_path, backend=backend, zero_stage=stage or 3)
    for res in results:
        assert res["metrics"]["loss"] == pytest.approx(one_process["metrics"]["loss"], abs=1e-6)
        assert res["metrics"]["grad_norm"] == pytest.approx(one_process["metrics"]["grad_norm"], rel=1e-5)
        assert sorted(res["adapters"]) == sorted(one_process["adapters"])
        for name, value in one_process["adapters"].items():
            assert torch.allclose(res["adapters"][name], value, atol=2e-6), name
        assert res["ref_vs_base"] <= 1e-6
        assert res["after_load"]["loss"] == res["after_save"]["loss"]
        critic = res["critic"]  # LoRA critic: adapters + a value head that trains, sharded the same way
        assert critic["losses"] == pytest.approx(one_process["critic"]["losses"], abs=1e-6)
        assert critic["losses"][1] < critic["losses"][0] and critic["after_load"] == critic["after_save"]
    # AdamW state over the adapters only, split over the ranks (ZeRO may pad its flat partitions)
    total = sum(res["optimizer_numel"] for res in results)
    assert one_process["optimizer_numel"] <= total <= one_process["optimizer_numel"] + 1024
