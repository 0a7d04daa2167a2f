"""hfrt's wire contract: message records, the msgpack codec, keyed-BLAKE2b signing and limits.

This package knows bytes, msgpack and hashing; it knows nothing of sockets, asyncio or torch.
The written spec is protocols/README.md.
"""

from __future__ import annotations

from hfrt.protocols.codec import Codec, Limits, OutOfBand, register_record
from hfrt.protocols.endpoints import EndpointEntry, Param, ParamKind, read_endpoint_table
from hfrt.protocols.handles import BatchHandle, Shard, TensorHandle
from hfrt.protocols.messages import (
    HEARTBEAT_MAX_S,
    HEARTBEAT_MIN_S,
    PROTOCOL_VERSION,
    Bye,
    Call,
    Cancel,
    Error,
    Heartbeat,
    Hello,
    Message,
    Partial,
    Reply,
    Shutdown,
    Welcome,
    check_heartbeat_s,
)
from hfrt.protocols.signing import KeyFileError, Signer, load_key, new_key, write_key_file
from hfrt.protocols.wire import (
    BadSignature,
    FrameTooLarge,
    Undecodable,
    UnknownKind,
    Wire,
    WireError,
)

__all__ = [
    "HEARTBEAT_MAX_S",
    "HEARTBEAT_MIN_S",
    "PROTOCOL_VERSION",
    "BadSignature",
    "Bye",
    "Call",
    "Cancel",
    "Codec",
    "EndpointEntry",
    "Error",
    "FrameTooLarge",
    "Heartbeat",
    "Hello",
    "KeyFileError",
    "Limits",
    "Message",
    "OutOfBand",
    "Param",
    "ParamKind",
    "Partial",
    "Reply",
    "Shutdown",
    "Signer",
    "BatchHandle",
    "Shard",
    "TensorHandle",
    "Undecodable",
    "UnknownKind",
    "Welcome",
    "Wire",
    "WireError",
    "check_heartbeat_s",
    "load_key",
    "new_key",
    "read_endpoint_table",
    "register_record",
    "write_key_file",
]
