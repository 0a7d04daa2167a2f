"""msgpack codec for hfrt values: strict types, registered records as ext types, big buffers out of band.

It encodes None, bool, int, float, str, bytes, list/tuple (decoded as list), dict, registered record
types, and OutOfBand buffers (sent as separate frames, never copied into the body). Anything else is
refused with a TypeError naming the type; nothing is ever unpickled. It knows nothing of signing
or message kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

#: Ext code of an out-of-band buffer reference; its payload is the buffer's frame index.
EXT_OOB = 0
#: Byte pairs every msgpack timestamp (ext -1) contains: fixext 4/8 marker, or an ext length of
#: 4, 8 or 12 followed by the type byte. msgpack decodes ext -1 itself, without our ext hook, so
#: a body holding one of these is searched for Timestamp values (rare: most bodies hold none).
_TIMESTAMP_MARKS = (b"\xd6\xff", b"\xd7\xff", b"\x04\xff", b"\x08\xff", b"\x0c\xff")


#: ExtType from a (code, data) pair: namedtuple's own constructor, without ExtType.__new__'s type
#: checks (our codes and bytes are right by construction), half the cost per handle sent
_make_ext = msgpack.ExtType._make


def _may_hold_timestamp(body: bytes) -> bool:
    """Whether `body` holds a timestamp mark. Every mark ends in 0xff, which most bodies lack:
    callers test `b"\xff" in body` inline first (no call for the common body), the five mark
    searches run only for the rest."""
    return b"\xff" in body and any(mark in body for mark in _TIMESTAMP_MARKS)


def _refuse_timestamps(value: Any) -> None:
    """Raise ValueError if `value` holds a msgpack Timestamp (ext -1 is not an hfrt type)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is list or kind is tuple:
            stack.extend(item)
        elif kind is dict:
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind is msgpack.Timestamp:
            raise ValueError("unknown ext type -1 (msgpack timestamp is not an hfrt value)")


class Record(Protocol):
    """A small typed record that can travel inside values (e.g. TensorHandle)."""

    def to_wire(self) -> list[Any]: ...

    @classmethod
    def from_wire(cls, values: list[Any]) -> Record: ...


_RECORDS_BY_CODE: dict[int, type[Any]] = {}
_CODES_BY_TYPE: dict[type[Any], int] = {}


def register_record(code: int, cls: type[Any]) -> type[Any]:
    """Let `cls` travel in values as msgpack ext type `code` (1..127, each code once)."""
    if not 1 <= code <= 127:
        raise ValueError(f"record ext code must be 1..127, got {code}")
    known = _RECORDS_BY_CODE.get(code)
    if known is not None and known is not cls:
        raise ValueError(f"ext code {code} already belongs to {known.__name__}")
    _RECORDS_BY_CODE[code] = cls
    _CODES_BY_TYPE[cls] = code
    return cls


class OutOfBand:
    """A large buffer sent as its own ZeroMQ frame rather than inside the msgpack body."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
        self.buffer = buffer

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutOfBand) and bytes(self.buffer) == bytes(other.buffer)

    def __repr__(self) -> str:
        return f"OutOfBand({len(memoryview(self.buffer).cast('B'))} bytes)"


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits a receiver enforces before trusting anything (and a sender checks first).

    max_frame_bytes: largest single frame. max_message_bytes: largest sum over a message's frames.
    max_frames: most frames in one message (signature + body + out-of-band buffers).
    """

    max_frame_bytes: int = 64 * 1024 * 1024
    max_message_bytes: int = 256 * 1024 * 1024
    max_frames: int = 64

    def __post_init__(self) -> None:
        if min(self.max_frame_bytes, self.max_message_bytes, self.max_frames) < 1:
            raise ValueError(f"limits must be positive: {self}")
        if self.max_message_bytes < self.max_frame_bytes:
            raise ValueError(
                f"max_message_bytes ({self.max_message_bytes}) < max_frame_bytes ({self.max_frame_bytes})"
            )

    def check(self, sizes: list[int]) -> str | None:
        """Return why a message with these frame sizes breaks the limits, or None."""
        total = sum(sizes)
        if total <= self.max_frame_bytes and len(sizes) <= self.max_frames:
            return None  # the common case: every frame, and the whole, are within bounds
        if len(sizes) > self.max_frames:
            return f"{len(sizes)} frames > max_frames {self.max_frames}"
        big = max(sizes, default=0)
        if big > self.max_frame_bytes:
            return f"frame of {big} bytes > max_frame_bytes {self.max_frame_bytes}"
        if total > self.max_message_bytes:
            return f"message of {total} bytes > max_message_bytes {self.max_message_bytes}"
        return None


class Codec:
    """Encodes one value tree to (body, buffers) and back. One instance per thread."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._buffers: list[Any] = []
        self._frames: list[bytes] = []
        #: registered records (handles) in the last decoded value: lets a receiver skip walking
        #: values that cannot contain any
        self.records_seen = 0
        #: the registered records (handles) the last encoded value held, in the order packed: lets a
        #: sender see what a message names without walking the value again
        self.records_packed: list[Any] = []
        self._packer = msgpack.Packer(default=self._default, use_bin_type=True)
        self._record_packer = msgpack.Packer(use_bin_type=True)  # a record's fields (plain values)
        # unpackb bounds every string, bytes, array, map and ext by the body's own length (msgpack's
        # default), and a body is at most max_frame_bytes: no explicit limits needed. A bound method
        # kept once, and no functools.partial: a call with two keywords costs half as much.
        self._hook = self._ext_hook

    def encode(self, value: Any) -> tuple[bytes, list[Any]]:
        """Return the msgpack body and the out-of-band buffers it refers to by index."""
        if self.records_packed:
            self.records_packed = []
        try:
            body = self._packer.pack(value)
        except Exception:
            self._packer.reset()
            self._buffers = []
            raise
        if b"\xff" in body and _may_hold_timestamp(body):
            try:
                _refuse_timestamps(value)
            except ValueError:
                self._buffers = []
                raise TypeError("hfrt cannot send a value of type msgpack.ext.Timestamp: send msgpack types, "
                                "registered records, or tensors by handle") from None
        if not self._buffers:
            return body, []
        buffers, self._buffers = self._buffers, []
        return body, buffers

    def decode(self, body: bytes, buffers: list[bytes] | None = None) -> Any:
        """Decode a body, resolving out-of-band references against `buffers`."""
        self._frames = buffers or []
        self.records_seen = 0
        value = msgpack.unpackb(body, ext_hook=self._hook, strict_map_key=False)  # strict_map_key: int keys, as the packer allows
        if b"\xff" in body and _may_hold_timestamp(body):
            _refuse_timestamps(value)
        return value

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_OOB:
            index = msgpack.unpackb(data)
            if not isinstance(index, int) or not 0 <= index < len(self._frames):
                raise ValueError(f"out-of-band reference {index!r} has no frame")
            return OutOfBand(self._frames[index])
        cls = _RECORDS_BY_CODE.get(code)
        if cls is None:
            raise ValueError(f"unknown ext type {code}")
        self.records_seen += 1
        values = msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=False)
        if b"\xff" in data and _may_hold_timestamp(data):  # most records' fields hold none: no walk
            _refuse_timestamps(values)
        if not isinstance(values, list):
            raise ValueError(f"ext type {code} ({cls.__name__}) payload is not a list")
        return cls.from_wire(values)

    def _default(self, obj: Any) -> Any:
        code = _CODES_BY_TYPE.get(type(obj))
        if code is not None:
            self.records_packed.append(obj)
            return _make_ext((code, self._record_packer.pack(obj.to_wire())))
        if isinstance(obj, OutOfBand):
            self._buffers.append(obj.buffer)
            return _make_ext((EXT_OOB, msgpack.packb(len(self._buffers) - 1)))
        raise TypeError(
            f"hfrt cannot send a value of type {type(obj).__module__}.{type(obj).__qualname__}: "
            "send msgpack types, registered records, or tensors by handle"
        )
