"""Message ⇄ frames: `[signature ‖ body, *out-of-band buffers]`, checked in a fixed order.

Frame 0 is the 32-byte keyed BLAKE2b signature followed by the msgpack body (one frame rather than
two: each ZeroMQ frame costs a send call, and this is the hot path).

A receiver checks sizes first, then the signature, and only then decodes; a frame that fails
any step raises a WireError saying which step and why. This module knows the codec, signing and
message kinds; it knows nothing of sockets or routing identities.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from hfrt.protocols.codec import Codec, Limits
from hfrt.protocols.messages import KINDS, Call, Message, Reply
from hfrt.protocols.signing import SIGNATURE_BYTES, Signer

# pack_calls writes a Call's body as [KIND, call_id] + its other fields encoded once: that needs
# the layout [kind, call_id, endpoint, args, kwargs, reply] with nothing optional.
assert Call.FIELD_NAMES == ("call_id", "endpoint", "args", "kwargs", "reply") and not Call.OPTIONAL
#: a six-element msgpack array's header and the Call kind (a positive fixint)
_CALL_HEAD = bytes((0x96, Call.KIND))
_REPLY_KIND = Reply.KIND


class WireError(ValueError):
    """A message could not be accepted (receive side) or sent (send side)."""


class FrameTooLarge(WireError):
    """Too many frames, a frame over max_frame_bytes, or a message over max_message_bytes."""


class BadSignature(WireError):
    """Missing, malformed or wrong signature: the message was not read."""


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
        self._ints = msgpack.Packer()  # call ids for pack_calls

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

    def pack_calls(self, call_ids: Sequence[int], endpoint: str, args: list[Any], kwargs: dict[str, Any],
                   reply: bool = True) -> list[list[Any]]:
        """The frames pack() makes for `Call(call_id, endpoint, args, kwargs, reply)`, one list per
        id, with the arguments encoded once: a broadcast's messages differ only in their call id,
        so each costs its id, a concatenation and its signature. Raises as pack() does."""
        fields, buffers = self.codec.encode([endpoint, args, kwargs, reply])
        tail = fields[1:]  # the four fields without their array header (one byte: 0x94)
        sizes = [memoryview(f).nbytes for f in buffers]
        out = []
        for call_id in call_ids:
            body = _CALL_HEAD + self._ints.pack(call_id) + tail
            problem = self.limits.check([SIGNATURE_BYTES + len(body), *sizes]) if buffers or len(body) > self._single_frame_max else None
            if problem:
                raise FrameTooLarge(f"cannot send {Call.NAME}: {problem}")
            out.append([self.signer.sign(self._signed(body, buffers) if buffers else (body,)) + body, *buffers])
        return out

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
            raise BadSignature("signature does not match (wrong cluster key or forged frame)")
        try:
            decoded = self.codec.decode(body, frames[1:])
        except Exception as exc:
            raise Undecodable(f"body is not a valid hfrt msgpack value: {exc}") from None
        # The message a controller reads most, once per rank per call: a well-formed Reply skips
        # the generic field checks (it has the types from_fields would accept), anything else takes them.
        if type(decoded) is list and len(decoded) == 4 and decoded[0] == _REPLY_KIND and type(decoded[1]) is int:
            elapsed = decoded[3]
            if type(elapsed) is float:
                return Reply(decoded[1], decoded[2], elapsed)
        if not isinstance(decoded, list) or not decoded or not isinstance(decoded[0], int):
            raise UnknownKind(f"body is not [kind, ...]: {type(decoded).__name__}")
        cls = KINDS.get(decoded[0])
        if cls is None:
            raise UnknownKind(f"unknown message kind {decoded[0]}")
        try:
            return cls.from_fields(decoded[1:])
        except (ValueError, TypeError) as exc:
            raise UnknownKind(str(exc)) from None
