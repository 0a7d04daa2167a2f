"""hfrt: a HybridFlow-style RL post-training runtime — an asyncio controller driving long-lived
role daemons with msgpack commands over ZeroMQ. This is the public face; the rest is detail.

Two audiences: role authors (`Daemon`, `endpoint`, `Dispatch`) and flow authors (`Trainer`,
`FlowConfig`, `get_roles`, `StageTimer`, `step_metrics`, `reduce_rank_metrics`,
`sampling_seed`, the errors). Importing it never imports torch.
"""

from __future__ import annotations

from hfrt.control.controller import Controller
from hfrt.control.recovery import RecoveryFailed
from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.flows.config import FlowConfig
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.timing import StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle, TensorHandle
from hfrt.wire.endpoints import Dispatch, endpoint
from hfrt.wire.errors import CallTimeout, DaemonGone, HfrtError, ProtocolMismatch, RemoteError, UnknownEndpoint

__all__ = [
    "BatchHandle",
    "CallTimeout",
    "Controller",
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
