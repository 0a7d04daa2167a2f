"""Message ⇄ frames: `[signature ‖ body, *out-of-band buffers]`, checked in a fixed order.

Frame 0 is the 32-byte HMAC-SHA256 signature followed by the msgpack body (one frame rather than
two: each ZeroMQ frame costs a send call, and this is the hot path).

A receiver checks sizes first, then the signature, and only then decodes; a frame that fails
any step raises a WireError saying which step and why. This module knows the codec, signing and
message kinds; it knows nothing of sockets or routing identities.
"""

from __future__ import annotations

from typing import Any

from hfrt.protocols.codec import Codec, Limits
from hfrt.protocols.messages import KINDS, Message
from hfrt.protocols.signing import SIGNATURE_BYTES, Signer


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

    def __init__(self, key: bytes, limits: Limits | None = None, *, sign_buffers: bool = True) -> None:
        """sign_buffers=False (the tensor data plane only): the signature covers the body and the
        buffers' lengths but not their bytes, so bulk tensor data is not hashed twice per transfer."""
        self.sign_buffers = sign_buffers
        self.limits = limits or Limits()
        self.codec = Codec(self.limits)
        self.signer = Signer(key)
        # A body this small makes a one-frame message that needs no further size checks.
        self._single_frame_max = self.limits.max_frame_bytes - SIGNATURE_BYTES

    def pack(self, message: Message) -> list[Any]:
        body, buffers = self.codec.encode(message.to_wire())
        if not buffers:
            if len(body) > self._single_frame_max:
                raise FrameTooLarge(f"cannot send {message.NAME}: {self.limits.check([SIGNATURE_BYTES + len(body)])}")
            return [self.signer.sign((body,)) + body]
        problem = self.limits.check([SIGNATURE_BYTES + len(body)] + [memoryview(f).nbytes for f in buffers])
        if problem:
            raise FrameTooLarge(f"cannot send {message.NAME}: {problem}")
        return [self.signer.sign(self._signed(body, buffers)) + body, *buffers]

    def _signed(self, body: Any, buffers: list[Any]) -> list[Any]:
        if self.sign_buffers:
            return [body, *buffers]
        return [body, b"".join(memoryview(b).nbytes.to_bytes(8, "little") for b in buffers)]

    def unpack(self, frames: list[bytes]) -> Message:
        if len(frames) != 1 or len(frames[0]) > self.limits.max_frame_bytes:
            problem = self.limits.check([len(f) for f in frames])
            if problem:
                raise FrameTooLarge(problem)
        if not frames or len(frames[0]) <= SIGNATURE_BYTES:
            raise BadSignature(f"expected [signature ‖ body, ...], got {len(frames)} frame(s) too short to hold one")
        head = frames[0]
        body = head[SIGNATURE_BYTES:]
        if not self.signer.verify(head[:SIGNATURE_BYTES], self._signed(body, list(frames[1:])) if len(frames) > 1 else [body]):
            raise BadSignature("HMAC signature does not match (wrong cluster key or forged frame)")
        try:
            decoded = self.codec.decode(body, frames[1:])
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
