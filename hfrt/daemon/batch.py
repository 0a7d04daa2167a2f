"""The tensor plane's batch container (verl's DataProto); it knows nothing of handles, daemons or transport.

A Batch is named tensor columns sharing their first dimension (the rows), non-tensor columns holding
one Python value per row, and a free-form meta dict. Row and column operations return new batches
(only `batch[name] = value` changes one in place); tensor columns are views where torch allows
(slices, `chunk`, `split`, `unpad`) and copies otherwise; non-tensor lists are new lists holding the
same Python objects (shallow)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate, pairwise
from types import MappingProxyType
from typing import Any, TypeVar, overload

import torch

from hfrt.wire.endpoints import chunk_bounds

V = TypeVar("V")


class Batch:
    """Columns of equal row count plus meta. A batch with no columns has 0 rows.

    `batch["name"]` reads a tensor or non-tensor column; `batch[rows]` (a slice, an index list or
    LongTensor, or a bool mask) selects rows. There is no `__eq__`: use `equals` for a value check.
    """

    __slots__ = ("_tensors", "_non_tensor", "_rows", "meta")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensor: Mapping[str, list[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        tensors, non_tensor = dict(tensors or {}), dict(non_tensor or {})
        self._rows = _validate(tensors, non_tensor)
        self._tensors: dict[str, torch.Tensor] = tensors
        self._non_tensor: dict[str, list[Any]] = {k: list(v) for k, v in non_tensor.items()}
        self.meta: dict[str, Any] = dict(meta or {})

    @classmethod
    def from_dict(
        cls,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensor: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build a batch; non-tensor columns may be any sequence but a string (tuples become lists)."""
        return cls(tensors, {k: _as_list(k, v) for k, v in (non_tensor or {}).items()}, meta)

    # -- columns -------------------------------------------------------------------------------

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Read-only view of the tensor columns (add or replace one with `batch[name] = tensor`)."""
        return MappingProxyType(self._tensors)

    @property
    def non_tensor(self) -> Mapping[str, list[Any]]:
        """Read-only view of the non-tensor columns (add or replace one with `batch[name] = list`)."""
        return MappingProxyType(self._non_tensor)

    def __len__(self) -> int:
        return self._rows

    def keys(self) -> list[str]:
        """Names of the tensor columns, in insertion order."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors or name in self._non_tensor

    @overload
    def __getitem__(self, key: str) -> torch.Tensor | list[Any]: ...
    @overload
    def __getitem__(self, key: slice | Sequence[int] | torch.Tensor) -> Batch: ...
    def __getitem__(self, key: str | slice | Sequence[int] | torch.Tensor) -> torch.Tensor | list[Any] | Batch:
        if isinstance(key, str):
            return self._column(key)
        if isinstance(key, slice):
            return self._slice(key)
        if isinstance(key, int):
            raise TypeError(f"select rows with a slice or index list (batch[{key}:{key} + 1]), not an int")
        return self._take(_row_index(key, self._rows))

    def __setitem__(self, name: str, value: torch.Tensor | list[Any]) -> None:
        """Add or replace a column; its row count must match the batch's other columns."""
        tensors, non_tensor = dict(self._tensors), dict(self._non_tensor)
        tensors.pop(name, None)
        non_tensor.pop(name, None)
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, list):
            non_tensor[name] = list(value)
        else:
            raise TypeError(f"column {name!r}: a torch.Tensor or a list, not {type(value).__name__}")
        if tensors.keys() | non_tensor.keys() != {name}:
            _check_rows(name, _column_length(name, value), self._rows)
        self._rows = _validate(tensors, non_tensor)
        self._tensors, self._non_tensor = tensors, non_tensor

    def select(
        self,
        tensor_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> Batch:
        """A batch with only the named columns and meta keys (None keeps all of that kind)."""
        return Batch(
            _pick("tensor column", self._tensors, tensor_keys),
            _pick("non-tensor column", self._non_tensor, non_tensor_keys),
            _pick("meta key", self.meta, meta_keys),
        )

    def union(self, other: Batch) -> Batch:
        """Columns and meta of both. A name present in both must hold equal values (else ValueError).

        A batch with no columns fits any row count, so meta-only batches merge into anything.
        """
        if self._ncols() and other._ncols() and len(self) != len(other):
            raise ValueError(f"union: the batches have {len(self)} and {len(other)} rows")
        return Batch(
            _merged("tensor column", self._tensors, other._tensors),
            _merged("non-tensor column", self._non_tensor, other._non_tensor),
            _merged("meta key", self.meta, other.meta),
        )

    # -- rows ----------------------------------------------------------------------------------

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order. Every batch needs the same columns, dtypes and row shapes.

        Meta is the first batch's, taken as is and not compared with the others': shards of one
        batch carry the same meta, and per-shard meta (timings, counts) is the caller's to merge.
        """
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, other in enumerate(batches[1:], start=1):
            _check_concatenable(first, other, i)
        tensors = {k: torch.cat([b._tensors[k] for b in batches]) for k in first._tensors}
        non_tensor = {k: [x for b in batches for x in b._non_tensor[k]] for k in first._non_tensor}
        return Batch(tensors, non_tensor, first.meta)

    def chunk(self, n: int) -> list[Batch]:
        """`n` contiguous row ranges, the first len % n one row longer (`dispatch.chunk_bounds`)."""
        if n < 1:
            raise ValueError(f"chunk needs n >= 1, got {n}")
        return [self[lo:hi] for lo, hi in chunk_bounds(self._rows, n)]

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Contiguous row ranges of the given sizes, which must be >= 0 and add up to len."""
        if any(s < 0 for s in sizes) or sum(sizes) != self._rows:
            raise ValueError(f"split sizes {list(sizes)} do not add up to the batch's {self._rows} rows")
        return [self[lo:hi] for lo, hi in pairwise(accumulate(sizes, initial=0))]

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row `times` times in a row (r0, r0, r1, r1: GRPO's n samples per prompt), or with
        interleave=False the whole batch `times` times over (r0, r1, r0, r1)."""
        if times < 0:
            raise ValueError(f"repeat needs times >= 0, got {times}")
        if interleave:
            return self._map(
                lambda t: t.repeat_interleave(times, dim=0),
                lambda v: [x for x in v for _ in range(times)],
            )
        return self._map(lambda t: t.repeat(times, *[1] * (t.dim() - 1)), lambda v: v * times)

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append rows so len is a multiple of `divisor`, repeating the first rows cyclically (0, 1, ...,
        wrapping round if more padding than rows is needed). Returns (padded batch, pad count)."""
        if divisor < 1:
            raise ValueError(f"pad_to_divisor needs a divisor >= 1, got {divisor}")
        pad = -self._rows % divisor
        if pad == 0:
            return self[:], 0
        rows = torch.cat([torch.arange(self._rows), torch.arange(pad) % self._rows])
        return self._take(rows), pad

    def unpad(self, pad: int) -> Batch:
        """The batch without its last `pad` rows (undoes `pad_to_divisor`)."""
        if not 0 <= pad <= self._rows:
            raise ValueError(f"unpad({pad}) on a batch of {self._rows} rows")
        return self[: self._rows - pad]

    # -- storage -------------------------------------------------------------------------------

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its tensor columns on `device` (non-tensor columns and meta unchanged)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking), lambda v: v)

    def contiguous(self) -> Batch:
        """The batch with every tensor column contiguous (views of a slice become compact copies)."""
        return self._map(lambda t: t.contiguous(), lambda v: v)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor columns' elements (a view counts its own elements, not its storage)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def equals(self, other: object) -> bool:
        """Same columns (any order), dtypes, shapes, devices and values (NaN equals NaN), same
        non-tensor values (==) and same meta."""
        return (
            isinstance(other, Batch)
            and len(self) == len(other)
            and self._tensors.keys() == other._tensors.keys()
            and all(_tensors_equal(t, other._tensors[k]) for k, t in self._tensors.items())
            and _same(self._non_tensor, other._non_tensor)
            and _same(self.meta, other.meta)
        )

    def __repr__(self) -> str:
        cols = ", ".join(
            f"{k}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for k, t in self._tensors.items()
        )
        names, meta = list(self._non_tensor), list(self.meta)
        return f"Batch(rows={self._rows}, tensors={{{cols}}}, non_tensor={names}, meta={meta})"

    # -- helpers -------------------------------------------------------------------------------

    def _ncols(self) -> int:
        return len(self._tensors) + len(self._non_tensor)

    def _column(self, name: str) -> torch.Tensor | list[Any]:
        if name in self._tensors:
            return self._tensors[name]
        if name in self._non_tensor:
            return self._non_tensor[name]
        have = f"tensor columns {list(self._tensors)}, non-tensor {list(self._non_tensor)}"
        raise KeyError(f"no column {name!r}; {have}")

    def _slice(self, key: slice) -> Batch:
        start, stop, step = key.indices(self._rows)
        if step < 0:  # torch has no negative-step views
            return self._take(torch.arange(start, stop, step))
        return self._map(lambda t: t[start:stop:step], lambda v: v[start:stop:step])

    def _take(self, rows: torch.Tensor) -> Batch:
        """Rows at the given 1-D int64 CPU positions (all within range, none negative)."""
        positions = rows.tolist()
        return self._map(lambda t: t.index_select(0, rows.to(t.device)), lambda v: [v[i] for i in positions])

    def _map(
        self, on_tensor: Callable[[torch.Tensor], torch.Tensor], on_list: Callable[[list[Any]], list[Any]]
    ) -> Batch:
        return Batch(
            {k: on_tensor(t) for k, t in self._tensors.items()},
            {k: on_list(v) for k, v in self._non_tensor.items()},
            self.meta,
        )


def _validate(tensors: Mapping[str, Any], non_tensor: Mapping[str, Any]) -> int:
    """Check names, column types and lengths; the shared row count (0 with no columns)."""
    both = tensors.keys() & non_tensor.keys()
    if both:
        raise ValueError(f"column {sorted(both)[0]!r} is both a tensor and a non-tensor column")
    rows: int | None = None
    first = ""
    for name, n in _lengths(tensors, non_tensor):
        if rows is None:
            rows, first = n, name
        elif n != rows:
            raise ValueError(f"column {name!r} has {n} rows but column {first!r} has {rows}")
    return rows or 0


def _lengths(tensors: Mapping[str, Any], non_tensor: Mapping[str, Any]) -> Iterator[tuple[str, int]]:
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tensor column {name!r} is a {type(value).__name__}, not a torch.Tensor")
        yield name, _column_length(name, value)
    for name, value in non_tensor.items():
        if not isinstance(value, list):
            raise TypeError(f"non-tensor column {name!r} is a {type(value).__name__}, not a list")
        yield name, _column_length(name, value)


def _column_length(name: object, value: torch.Tensor | list[Any]) -> int:
    if not isinstance(name, str):
        raise TypeError(f"column names are strings, got {name!r}")
    if isinstance(value, list):
        return len(value)
    if value.dim() == 0:
        raise ValueError(f"tensor column {name!r} is 0-dimensional; a column needs a row dimension")
    return int(value.shape[0])


def _check_rows(name: str, n: int, rows: int) -> None:
    if n != rows:
        raise ValueError(f"column {name!r} has {n} rows but the batch has {rows}")


def _as_list(name: str, values: Sequence[Any]) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"non-tensor column {name!r} must be a sequence of per-row values, not {type(values).__name__}")
    return list(values)


def _row_index(key: Sequence[int] | torch.Tensor, rows: int) -> torch.Tensor:
    """Row positions for an index list, integer tensor or bool mask: 1-D int64 on CPU, negatives resolved."""
    if not isinstance(key, torch.Tensor):
        values = list(key)
        if values and all(isinstance(v, bool) for v in values):
            key = torch.tensor(values, dtype=torch.bool)
        else:
            key = torch.tensor([operator.index(v) for v in values], dtype=torch.int64)
    if key.dim() != 1:
        raise ValueError(f"a row index must be 1-D, got shape {tuple(key.shape)}")
    if key.numel() == 0:  # torch.tensor([]) is float32; an empty index of any dtype selects no rows
        return torch.empty(0, dtype=torch.int64)
    if key.dtype == torch.bool:
        if key.numel() != rows:
            raise ValueError(f"bool mask has {key.numel()} entries but the batch has {rows} rows")
        return key.cpu().nonzero().squeeze(1)
    if key.is_floating_point() or key.is_complex():
        raise TypeError(f"a row index tensor must be integer or bool, not {key.dtype}")
    idx = key.cpu().to(torch.int64)
    bad = (idx < -rows) | (idx >= rows)
    if bool(bad.any()):
        raise IndexError(f"row index {int(idx[bad][0])} is out of range for a batch of {rows} rows")
    return torch.where(idx < 0, idx + rows, idx)


def _pick(what: str, source: Mapping[str, V], keys: Iterable[str] | None) -> dict[str, V]:
    if keys is None:
        return dict(source)
    if isinstance(keys, str):
        raise TypeError(f"select takes a list of {what} names, not the string {keys!r}")
    wanted = list(keys)
    for k in wanted:
        if k not in source:
            raise KeyError(f"no {what} {k!r}; have {list(source)}")
    return {k: source[k] for k in wanted}


def _merged(what: str, mine: Mapping[str, V], theirs: Mapping[str, V]) -> dict[str, V]:
    out = dict(mine)
    for name, value in theirs.items():
        if name in out and not _same(out[name], value):
            raise ValueError(f"union: {what} {name!r} differs between the two batches")
        out.setdefault(name, value)
    return out


def _check_concatenable(first: Batch, other: Batch, i: int) -> None:
    for kind, mine, theirs in (
        ("tensor", first.tensors, other.tensors),
        ("non-tensor", first.non_tensor, other.non_tensor),
    ):
        if mine.keys() != theirs.keys():
            missing, extra = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
            diff = f"missing {missing}, extra {extra}"
            raise ValueError(f"concat: batch {i} {kind} columns differ from batch 0's ({diff})")
    for name, t in first.tensors.items():
        u = other.tensors[name]
        if u.dtype != t.dtype or u.shape[1:] != t.shape[1:]:
            raise ValueError(
                f"concat: column {name!r} has rows of {tuple(u.shape[1:])} {u.dtype} in batch {i}"
                f" but {tuple(t.shape[1:])} {t.dtype} in batch 0"
            )


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    return torch.equal(a, b)


def _same(a: Any, b: Any) -> bool:
    """Value equality for column and meta values: tensors by `_tensors_equal`, the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):  # e.g. lists of tensors: no single truth value
        return False
