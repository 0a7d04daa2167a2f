"""hfrt: a HybridFlow-style RL post-training runtime — an asyncio controller driving long-lived
role daemons with msgpack commands over ZeroMQ. This is the public face; the rest is detail.

Two audiences: role authors (`Daemon`, `endpoint`, `Dispatch`) and flow authors (`Trainer`,
`FlowConfig`, `get_roles`, `StageTimer`, `step_metrics`, `reduce_rank_metrics`,
`sampling_seed`, the errors). Importing it never imports torch. The flow-author names load on
first use (module `__getattr__`), so a daemon's start-up does not import the flow machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hfrt.control.controller import Controller
from hfrt.control.recovery import RecoveryFailed
from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.protocols import BatchHandle, TensorHandle
from hfrt.wire.endpoints import Dispatch, endpoint
from hfrt.wire.errors import (
    BadArguments,
    CallTimeout,
    ControllerFailed,
    DaemonGone,
    HfrtError,
    ProtocolMismatch,
    RemoteError,
    UnknownEndpoint,
)

if TYPE_CHECKING:
    from hfrt.flows.config import FlowConfig
    from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
    from hfrt.flows.timing import StageTimer
    from hfrt.flows.trainer import Trainer, get_roles, sampling_seed

#: The flow-author API: name → the module that owns it (imported when the name is first used).
_FLOW_API = {
    "FlowConfig": "hfrt.flows.config",
    "StageTimer": "hfrt.flows.timing",
    "Trainer": "hfrt.flows.trainer",
    "get_roles": "hfrt.flows.trainer",
    "reduce_rank_metrics": "hfrt.flows.metrics",
    "sampling_seed": "hfrt.flows.trainer",
    "step_metrics": "hfrt.flows.metrics",
}

__all__ = [
    "BadArguments",
    "BatchHandle",
    "CallTimeout",
    "Controller",
    "ControllerFailed",
    "Daemon",
    "DaemonContext",
    "DaemonGone",
    "Dispatch",
    "FlowConfig",
    "HfrtError",
    "ProtocolMismatch",
    "RecoveryFailed",
    "RemoteError",
    "StageTimer",
    "TensorHandle",
    "Trainer",
    "UnknownEndpoint",
    "endpoint",
    "get_roles",
    "reduce_rank_metrics",
    "sampling_seed",
    "step_metrics",
]


def __getattr__(name: str) -> Any:
    if name not in _FLOW_API:
        raise AttributeError(f"module 'hfrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_FLOW_API[name]), name)
    globals()[name] = value
    return value
