"""The names hfrt.flows.common used to hold, kept for code that imports them from here; new code
imports from hfrt (the flow-author API) or from the module that owns each name.

FlowConfig and CALL_TIMEOUT_S live in hfrt.flows.config, StageTimer in hfrt.flows.timing, the
metric helpers in hfrt.flows.metrics, prompt batches in hfrt.flows.batches, get_roles in
hfrt.flows.trainer. This module defines nothing.
"""

from __future__ import annotations

from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S, DATA_DEFAULTS, FlowConfig
from hfrt.flows.metrics import (
    MAX_OVER_RANKS,
    reduce_rank_metrics,
    reward_stats,
    rollout_metrics,
    step_metrics,
    throughput,
)
from hfrt.flows.timing import StageTimer
from hfrt.flows.trainer import get_roles

__all__ = [
    "CALL_TIMEOUT_S",
    "DATA_DEFAULTS",
    "MAX_OVER_RANKS",
    "FlowConfig",
    "StageTimer",
    "get_roles",
    "non_tensor",
    "prompts_handle",
    "reduce_rank_metrics",
    "reward_stats",
    "rollout_metrics",
    "step_metrics",
    "throughput",
]
