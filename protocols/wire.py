"""Message ⇄ frames: `[signature, body, *out-of-band buffers]`, checked in a fixed order.

A receiver checks sizes first, then the signature, and only then decodes; a frame that fails
any step raises a WireError saying which step and why. This module knows the codec, signing and
message kinds; it knows nothing of sockets or routing identities.
"""

from __future__ import annotations

from typing import Any

from .codec import Codec, Limits
from .messages import KINDS, Message
from .signing import SIGNATURE_BYTES, Signer


class WireError(ValueError):
    """A message could not be accepted (receive side) or sent (send side)."""


class FrameTooLarge(WireError):
    """Too many frames, a frame over max_frame_bytes, or a message over max_message_bytes."""


class BadSignature(WireError):
    """Missing, malformed or wrong HMAC signature: the message was not read."""


class Undecodable(WireError):
    """Signed correctly but not valid msgpack, or an unknown ext type."""


class UnknownKind(WireError):
    """Decoded, but not a message kind this protocol version knows, or its fields are wrong."""


class Wire:
    """Packs and unpacks messages for one thread (it owns a Codec and a Signer)."""

    def __init__(self, key: bytes, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.codec = Codec(self.limits)
        self.signer = Signer(key)

    def pack(self, message: Message) -> list[Any]:
        body, buffers = self.codec.encode(message.to_wire())
        frames: list[Any] = [body, *buffers]
        problem = self.limits.check(
            [SIGNATURE_BYTES] + [memoryview(f).nbytes for f in frames]
        )
        if problem:
            raise FrameTooLarge(f"cannot send {message.NAME}: {problem}")
        return [self.signer.sign(frames), *frames]

    def unpack(self, frames: list[bytes]) -> Message:
        problem = self.limits.check([len(f) for f in frames])
        if problem:
            raise FrameTooLarge(problem)
        if len(frames) < 2 or len(frames[0]) != SIGNATURE_BYTES:
            raise BadSignature(f"expected [signature, body, ...], got {len(frames)} frame(s)")
        if not self.signer.verify(frames[0], frames[1:]):
            raise BadSignature("HMAC signature does not match (wrong cluster key or forged frame)")
        try:
            decoded = self.codec.decode(frames[1], frames[2:])
        except Exception as exc:
            raise Undecodable(f"body is not a valid hfrt msgpack value: {exc}") from None
        if not isinstance(decoded, list) or not decoded or not isinstance(decoded[0], int):
            raise UnknownKind(f"body is not [kind, ...]: {type(decoded).__name__}")
        cls = KINDS.get(decoded[0])
        if cls is None:
            raise UnknownKind(f"unknown message kind {decoded[0]}")
        try:
            return cls.from_fields(decoded[1:])
        except (ValueError, TypeError) as exc:
            raise UnknownKind(str(exc)) from None
