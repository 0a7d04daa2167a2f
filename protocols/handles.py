"""The tensor-handle record: a name for a tensor that stays on the daemon that made it.

This module only defines the record and its wire form; the tensor store and the transfer
backends that give a handle its behaviour live daemon-side in hfrt (the tensor plane).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .codec import register_record

#: msgpack ext code of TensorHandle.
EXT_TENSOR_HANDLE = 1


@dataclass(frozen=True, slots=True)
class TensorHandle:
    """Where a tensor lives and what it is, without its bytes.

    owner: the owning daemon's identity ("actor:0").
    key: the owner's store key for the tensor.
    shape / dtype / device: as torch reports them ("float32", "cpu", "cuda:0").
    nbytes: the payload size in bytes.
    rows: for a row slice of a distributed batch, the half-open row range [start, stop) in the
        whole batch; None for a whole tensor.
    """

    owner: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    rows: tuple[int, int] | None = None

    def to_wire(self) -> list[Any]:
        rows = list(self.rows) if self.rows is not None else None
        return [self.owner, self.key, list(self.shape), self.dtype, self.device, self.nbytes, rows]

    @classmethod
    def from_wire(cls, values: list[Any]) -> TensorHandle:
        if len(values) != 7:
            raise ValueError(f"TensorHandle: expected 7 fields, got {len(values)}")
        owner, key, shape, dtype, device, nbytes, rows = values
        for name, value in (("owner", owner), ("key", key), ("dtype", dtype), ("device", device)):
            if not isinstance(value, str):
                raise ValueError(f"TensorHandle.{name}: expected str, got {type(value).__name__}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"TensorHandle.shape: expected a list of ints >= 0, got {shape!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"TensorHandle.nbytes: expected an int >= 0, got {nbytes!r}")
        if rows is not None and not (
            isinstance(rows, list)
            and len(rows) == 2
            and all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
            and 0 <= rows[0] <= rows[1]
        ):
            raise ValueError(f"TensorHandle.rows: expected [start, stop] or None, got {rows!r}")
        return cls(owner, key, tuple(shape), dtype, device, nbytes, None if rows is None else (rows[0], rows[1]))


register_record(EXT_TENSOR_HANDLE, TensorHandle)
