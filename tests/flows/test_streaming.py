"""Streamed scoring's controller-side pieces: the stream_chunks check, chunk bounds, and the
rollout chunks' meta joined into one (sums, maxima, row-weighted means)."""

from __future__ import annotations

import pytest

from hfrt.flows.batches import concat_rollouts
from hfrt.flows.grpo_family import GRPOConfig, GRPOFlowConfig
from hfrt.flows.recipes.ppo import PPOFlowConfig
from hfrt.flows.recipes.safe_rlhf import SafeRLHFConfig
from hfrt.protocols import BatchHandle


def test_stream_chunks_is_checked_before_launch() -> None:
    assert GRPOFlowConfig.read({"stream_chunks": 4, "prompts_per_step": 4}).stream_chunks == 4
    assert PPOFlowConfig.read({"stream_chunks": 2}).stream_chunks == 2
    with pytest.raises(ValueError, match="stream_chunks=0: must be an int of at least 1"):
        GRPOFlowConfig.read({"stream_chunks": 0})
    with pytest.raises(ValueError, match="stream_chunks=5: more chunks than prompts_per_step=4"):
        GRPOFlowConfig.read({"stream_chunks": 5, "prompts_per_step": 4})
    for config in (GRPOConfig, SafeRLHFConfig):  # flows that generate in one call refuse it
        with pytest.raises(ValueError, match="generates in one call"):
            config.read({"stream_chunks": 2})


def test_chunk_bounds_cover_the_rows_in_order() -> None:
    from hfrt.roles.generation.batches import chunk_bounds

    assert [chunk_bounds(i, 3, 8) for i in range(3)] == [(0, 2), (2, 5), (5, 8)]
    assert chunk_bounds(None, 1, 5) == (0, 5)
    with pytest.raises(ValueError, match="need 0 <= chunk < chunks"):
        chunk_bounds(2, 2, 4)


def test_rollout_chunks_meta_joined() -> None:
    a = BatchHandle.inline({"x": [1, 2]}, {"response_tokens": 6.0, "response_length/mean": 3.0, "response_length/max": 4.0,
                                          "response_length/min": 2.0, "timing/generate_s": 1.0, "memory/peak_rss_mb": 10.0,
                                          "temperature": 1.0})
    b = BatchHandle.inline({"x": [3, 4, 5, 6]}, {"response_tokens": 4.0, "response_length/mean": 1.0, "response_length/max": 2.0,
                                                "response_length/min": 0.0, "timing/generate_s": 2.0, "memory/peak_rss_mb": 5.0,
                                                "temperature": 1.0})
    joined = concat_rollouts([a, b])
    assert len(joined) == 6
    assert joined.meta == {"response_tokens": 10.0, "response_length/mean": pytest.approx(10 / 6), "response_length/max": 4.0,
                           "response_length/min": 0.0, "timing/generate_s": 3.0, "memory/peak_rss_mb": 10.0, "temperature": 1.0}
