"""hfrt: a HybridFlow-style RL post-training runtime — an asyncio controller driving long-lived
role daemons with msgpack commands over ZeroMQ. This is the public face; the rest is detail.
"""

from __future__ import annotations

from .controller import Controller
from .daemon import Daemon, DaemonContext
from .endpoints import Dispatch, endpoint
from .errors import CallTimeout, DaemonGone, HfrtError, ProtocolMismatch, RemoteError, UnknownEndpoint
from .protocols import BatchHandle, TensorHandle
from .recovery import RecoveryFailed

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
