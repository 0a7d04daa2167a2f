"""hfrt: a HybridFlow-style RL post-training runtime — an asyncio controller driving long-lived
role daemons with msgpack commands over ZeroMQ. This is the public face; the rest is detail.

Two audiences: role authors (`Daemon`, `endpoint`, `Dispatch`) and flow authors (`Trainer`,
`FlowConfig`, `get_roles`, `StageTimer`, `step_metrics`, the errors). Importing it never imports
torch.
"""

from __future__ import annotations

from hfrt.control.controller import Controller
from hfrt.control.recovery import RecoveryFailed
from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.flows.config import FlowConfig
from hfrt.flows.metrics import step_metrics
from hfrt.flows.timing import StageTimer
from hfrt.flows.trainer import Trainer, get_roles
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
    "step_metrics",
]
