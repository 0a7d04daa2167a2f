"""The filter that hides vLLM's reload warning for layers that get no checkpoint tensor by design."""

from __future__ import annotations

import logging

import pytest

from hfrt.roles.generation.vllm_engine import RELOAD_LOGGER, ExpectedReloadGaps


def _record(layer: str, msg: str = "%s: Failed to load weights") -> logging.LogRecord:
    return logging.LogRecord(RELOAD_LOGGER, logging.WARNING, __file__, 1, msg, (layer,), None)


@pytest.mark.parametrize(
    ("tied", "layer", "shown"),
    [
        (True, "RotaryEmbedding", False),
        (False, "Llama3RotaryEmbedding", False),
        (True, "ParallelLMHead", False),
        (False, "ParallelLMHead", True),  # an untied head that received nothing is a real gap
        (True, "QKVParallelLinear", True),
        (True, "VocabParallelEmbedding", True),
    ],
)
def test_only_expected_gaps_are_hidden(tied: bool, layer: str, shown: bool) -> None:
    assert ExpectedReloadGaps(tied).filter(_record(layer)) is shown


def test_other_messages_pass() -> None:
    assert ExpectedReloadGaps(True).filter(_record("RotaryEmbedding", "%s: Delayed processing"))
