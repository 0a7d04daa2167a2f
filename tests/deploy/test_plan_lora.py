"""`hfrt plan` with LoRA ([lora] role = rank): the adapters' grads, Adam state, gradient
all-reduce and weight sync replace the full model's, and with LoRA on the actor the reference's
passes run on the actor (no reference model to place)."""

from __future__ import annotations

import dataclasses

import pytest

from hfrt.deploy.plan.file import parse_plan
from hfrt.deploy.plan.model import HARDWARE, MODELS, Layout, Workload, static_memory, train_cost
from hfrt.deploy.plan.search import search
from hfrt.deploy.reader import SpecError

PLAN = {"flow": "grpo", "cluster": {"hardware": "H100", "nodes": 1, "devices_per_node": 8},
        "workload": {"prompts_per_step": 64, "samples_per_prompt": 4, "prompt_len": 256, "response_len": 256},
        "models": {"actor": "llama-7b", "reference": "llama-7b", "reward": "function"}}


def test_adapters_are_what_trains_and_moves() -> None:
    full = MODELS["smollm2-135m"]
    lora = dataclasses.replace(full, lora_rank=16)
    assert lora.adapter_params == 4_884_480  # what roles/training/lora.py counts with peft (tests/roles/test_lora.py)
    assert lora.trained_params / full.params == pytest.approx(0.0363, abs=1e-4)
    hw, layout = HARDWARE["H100"], Layout(1, 1, 1)
    # bf16 weights + fp32 Adam (+ master) of 3.6 % of the parameters, instead of the full 16 bytes/param
    assert static_memory(lora, layout, True, hw) < 0.2 * static_memory(full, layout, True, hw)
    w = Workload(prompts_per_step=64, response_len=256, prompt_len=256)
    dp8 = Layout(1, 1, 8)  # the gradient all-reduce moves the adapters' gradients only
    assert train_cost(lora, dp8, w, hw, 8).comm < 0.1 * train_cost(full, dp8, w, hw, 8).comm


def test_plan_file_lora_moves_the_reference_onto_the_actor() -> None:
    plain = parse_plan(PLAN).problem
    adapted = parse_plan(PLAN | {"lora": {"actor": 16}}).problem
    assert set(plain.models) == {"actor", "reference"} and set(adapted.models) == {"actor"}
    assert adapted.models["actor"].lora_rank == 16
    stage2 = {s.name: s.calls for s in adapted.stages}["stage2"]
    assert "forward" in stage2["actor"] and "reference" not in stage2
    best_full, best_lora = search(plain).ranked[0], search(adapted).ranked[0]
    assert max(m.peak for m in best_lora.memory) < max(m.peak for m in best_full.memory)
    with pytest.raises(SpecError, match=r"\[lora\] actor: the LoRA rank must be an integer > 0, got 0"):
        parse_plan(PLAN | {"lora": {"actor": 0}})
