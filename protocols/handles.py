"""Handle records: names for tensors and row-sharded batches that stay on the daemons that made them.

This module defines the records, their wire form and pure row arithmetic on them (slicing and
concatenating batch handles without touching any bytes). The tensor store and the transfer
backends that give a handle its behaviour live daemon-side in hfrt.daemon.tensors.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

from hfrt.protocols.codec import register_record

#: msgpack ext codes.
EXT_TENSOR_HANDLE = 1
EXT_BATCH_HANDLE = 2
#: owner of the shards of BatchHandle.inline(): no daemon (they hold no tensors)
INLINE_OWNER = ""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, weakref_slot=True)
class TensorHandle:
    """Where a tensor lives and what it is, without its bytes.

    owner: the owning daemon's identity ("actor:0").
    key: the owner's store key for the tensor.
    shape / dtype / device: of the whole stored tensor, as torch reports them.
    nbytes: the whole stored tensor's size in bytes.
    rows: the half-open range [start, stop) of first-dimension rows this handle refers to, or
        None for the whole tensor. Slicing a batch handle narrows `rows`; the key stays.
    """

    owner: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    rows: tuple[int, int] | None = None
    #: the handle this one was narrowed from (not on the wire): keeps the original alive, so
    #: freeing is driven by the last reference to any view of the stored tensor
    parent: Any = field(default=None, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        if self.rows is not None:
            return self.rows[1] - self.rows[0]
        return self.shape[0] if self.shape else 1

    @property
    def row_range(self) -> tuple[int, int]:
        return self.rows if self.rows is not None else (0, self.shape[0] if self.shape else 1)

    @property
    def selected_nbytes(self) -> int:
        """Bytes of the rows this handle selects."""
        total = self.shape[0] if self.shape else 1
        return self.nbytes * self.num_rows // max(total, 1)

    def narrow(self, start: int, stop: int) -> TensorHandle:
        """The rows [start, stop) of this handle's selection (relative to it)."""
        lo, hi = self.row_range
        if not 0 <= start <= stop <= hi - lo:
            raise IndexError(f"rows [{start}, {stop}) outside a {hi - lo}-row handle")
        # the constructor, not dataclasses.replace (several times slower): a dispatch narrows one per rank
        return TensorHandle(self.owner, self.key, self.shape, self.dtype, self.device, self.nbytes,
                            (lo + start, lo + stop), self.parent or self)

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
        if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
            raise ValueError(f"TensorHandle.shape: expected a list of ints >= 0, got {shape!r}")
        if not _int(nbytes) or nbytes < 0:
            raise ValueError(f"TensorHandle.nbytes: expected an int >= 0, got {nbytes!r}")
        if rows is not None:
            total = shape[0] if shape else 1
            if not (isinstance(rows, list) and len(rows) == 2 and all(_int(r) for r in rows)
                    and 0 <= rows[0] <= rows[1] <= total):
                raise ValueError(f"TensorHandle.rows: expected [start, stop] within {total} rows, got {rows!r}")
            rows = (rows[0], rows[1])
        return cls(owner, key, tuple(shape), dtype, device, nbytes, rows)


@dataclass(frozen=True, slots=True)
class Shard:
    """One owner's contiguous rows of a batch: its tensor columns (handles narrowed to the rows)
    and its non-tensor columns (small per-row values, carried inline)."""

    owner: str
    rows: int
    columns: dict[str, TensorHandle]
    non_tensor: dict[str, list[Any]] = field(default_factory=dict)
    #: the columns' wire form, made at the first send and kept (not compared, not on the wire):
    #: a step sends one batch's shards to several roles, and a handle never changes
    _columns_wire: dict[str, list[Any]] | None = field(default=None, init=False, compare=False, repr=False)

    def columns_wire(self) -> dict[str, list[Any]]:
        """{name: TensorHandle wire form} of the columns, made once."""
        made = self._columns_wire
        if made is None:
            made = {k: h.to_wire() for k, h in self.columns.items()}
            object.__setattr__(self, "_columns_wire", made)
        return made

    def narrow(self, start: int, stop: int) -> Shard:
        return Shard(
            self.owner,
            stop - start,
            {k: h.narrow(start, stop) for k, h in self.columns.items()},
            {k: v[start:stop] for k, v in self.non_tensor.items()},
        )


@dataclass(frozen=True, slots=True, weakref_slot=True)
class BatchHandle:
    """A distributed batch: an ordered list of row shards, each owned by one daemon.

    Row i of the batch is row i - (rows of earlier shards) of the shard that holds it. Slicing and
    concatenating handles is arithmetic on this list; no bytes move until a daemon pulls them.
    A slice costs the shards it keeps plus a bisection, not a walk over every shard, so cutting a
    batch of N shards into N data-parallel parts is O(N log N), not O(N²).
    meta: batch-level values (not per row), carried inline.
    """

    shards: tuple[Shard, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    #: the handles this one was sliced or concatenated from (not on the wire); see TensorHandle
    parents: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    #: rows up to the end of each shard (not on the wire): slicing finds its first shard by bisection
    _ends: tuple[int, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        shards = self.shards
        # one shard (each rank's part of a dispatch along shard bounds): no accumulate over a generator
        ends = (shards[0].rows,) if len(shards) == 1 else tuple(itertools.accumulate(s.rows for s in shards))
        object.__setattr__(self, "_ends", ends)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def owners(self) -> list[str]:
        return [s.owner for s in self.shards]

    @property
    def nbytes(self) -> int:
        return sum(h.selected_nbytes for s in self.shards for h in s.columns.values())

    def keys(self) -> list[str]:
        return list(self.shards[0].columns) if self.shards else []

    def slice(self, start: int, stop: int) -> BatchHandle:
        """Rows [start, stop) of the batch, as a handle over the same stored tensors."""
        ends = self._ends
        if not 0 <= start <= stop <= (ends[-1] if ends else 0):
            raise IndexError(f"rows [{start}, {stop}) outside a {len(self)}-row batch")
        i = bisect.bisect_right(ends, start)  # the first shard ending after `start`
        offset = ends[i - 1] if i else 0
        shards = self.shards
        if i < len(shards) and offset == start and ends[i] == stop:  # exactly one whole shard (a dispatch along shard bounds)
            return BatchHandle._made((shards[i],), (stop - start,), dict(self.meta), (self,))
        out = []
        while i < len(shards) and offset < stop:
            shard = shards[i]
            lo, hi = max(start - offset, 0), min(stop - offset, shard.rows)
            if lo == 0 and hi == shard.rows and hi:
                out.append(shard)  # all of it: the shard itself
            elif lo < hi:
                out.append(shard.narrow(lo, hi))
            offset += shard.rows
            i += 1
        return BatchHandle(tuple(out), dict(self.meta), (self,))

    @staticmethod
    def _made(shards: tuple[Shard, ...], ends: tuple[int, ...], meta: dict[str, Any], parents: tuple[Any, ...]) -> BatchHandle:
        """A handle whose row ends are already known: the dataclass's own constructor and its
        __post_init__ cost a microsecond, paid once per rank of every dispatch."""
        handle = object.__new__(BatchHandle)
        put = object.__setattr__
        put(handle, "shards", shards)
        put(handle, "meta", meta)
        put(handle, "parents", parents)
        put(handle, "_ends", ends)
        return handle

    @classmethod
    def inline(cls, non_tensor: dict[str, list[Any]], meta: dict[str, Any] | None = None) -> BatchHandle:
        """A batch of per-row Python values only (prompts, ground truths, ids), made where it is
        needed, e.g. in a flow: it holds no tensors, so it has no owner and nothing is pulled."""
        lengths = {k: len(v) for k, v in non_tensor.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"inline batch columns differ in length: {lengths}")
        rows = next(iter(lengths.values()), 0)
        return cls((Shard(INLINE_OWNER, rows, {}, {k: list(v) for k, v in non_tensor.items()}),), dict(meta or {}))

    @staticmethod
    def concat(parts: list[BatchHandle]) -> BatchHandle:
        """The batches one after another (meta from the first)."""
        shards = tuple(s for p in parts for s in p.shards if s.rows)
        return BatchHandle(shards, dict(parts[0].meta) if parts else {}, tuple(parts))

    def keys_by_owner(self) -> dict[str, list[str]]:
        """The store keys this batch refers to, per owning daemon."""
        out: dict[str, list[str]] = {}
        for shard in self.shards:
            out.setdefault(shard.owner, []).extend(h.key for h in shard.columns.values())
        return out

    def to_wire(self) -> list[Any]:
        return [
            [[s.owner, s.rows, s.columns_wire(), s.non_tensor] for s in self.shards],
            self.meta,
        ]

    @classmethod
    def from_wire(cls, values: list[Any]) -> BatchHandle:
        if len(values) != 2 or not isinstance(values[0], list) or not isinstance(values[1], dict):
            raise ValueError("BatchHandle: expected [shards, meta]")
        shards = []
        for raw in values[0]:
            if not (isinstance(raw, list) and len(raw) == 4 and isinstance(raw[0], str) and _int(raw[1])
                    and isinstance(raw[2], dict) and isinstance(raw[3], dict)):
                raise ValueError("BatchHandle shard: expected [owner, rows, columns, non_tensor]")
            owner, rows, columns, non_tensor = raw
            handles = {str(k): TensorHandle.from_wire(v) for k, v in columns.items()}
            for name, h in handles.items():
                if h.owner != owner or h.num_rows != rows:
                    raise ValueError(f"BatchHandle shard of {owner}: column {name!r} does not match its shard")
            for name, col in non_tensor.items():
                if not isinstance(col, list) or len(col) != rows:
                    raise ValueError(f"BatchHandle shard of {owner}: non-tensor column {name!r} is not {rows} rows")
            shards.append(Shard(owner, rows, handles, non_tensor))
        return cls(tuple(shards), values[1])


register_record(EXT_TENSOR_HANDLE, TensorHandle)
register_record(EXT_BATCH_HANDLE, BatchHandle)
