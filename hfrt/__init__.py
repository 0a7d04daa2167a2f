"""hfrt: a HybridFlow-style RL post-training runtime — an asyncio controller driving long-lived
role daemons with msgpack commands over ZeroMQ. This is the public face; the rest is detail.
"""

from __future__ import annotations

from hfrt.control.controller import Controller
from hfrt.control.recovery import RecoveryFailed
from hfrt.daemon.base import Daemon, DaemonContext
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
    "HfrtError",
    "ProtocolMismatch",
    "RecoveryFailed",
    "RemoteError",
    "TensorHandle",
    "UnknownEndpoint",
    "endpoint",
]
