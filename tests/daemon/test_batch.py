"""The Batch container: column round trips, row-operation invariants (property tests), error messages."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfrt.daemon.batch import Batch
from hfrt.wire.endpoints import chunk_bounds

fast = settings(max_examples=60, deadline=None)

PER_ROW_VALUES = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=6),
    st.floats(allow_nan=False),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=3),
)


@st.composite
def batches(draw: st.DrawFn, max_rows: int = 12) -> Batch:
    """A batch of 0..max_rows rows with float/bf16/int/bool columns of ranks 1-3 and mixed per-row values."""
    rows = draw(st.integers(0, max_rows))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    logp = torch.randn(rows, 3, generator=g)
    if rows and draw(st.booleans()):
        logp[0, 1] = math.nan  # equals() treats NaN as equal to NaN
    tensors = {
        "logp": logp,
        "reward": torch.randn(rows, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-5, 100, (rows, 2, 4), generator=g),
        "mask": torch.rand(rows, generator=g) > 0.5,
    }
    non_tensor = {
        "uid": [f"row{i}" for i in range(rows)],  # makes every row distinguishable
        "extra": draw(st.lists(PER_ROW_VALUES, min_size=rows, max_size=rows)),
    }
    return Batch(tensors, non_tensor, {"step": 3, "temperature": 0.7})


def small() -> Batch:
    return Batch.from_dict(
        tensors={"x": torch.arange(8).reshape(4, 2), "m": torch.tensor([True, False, True, False])},
        non_tensor={"s": ("a", "b", "c", "d")},
        meta={"k": 1},
    )


# -- round trips of every column type --------------------------------------------------------

TENSOR_COLUMNS: dict[str, Callable[[int], torch.Tensor]] = {
    "float32-rank1": lambda n: torch.randn(n),
    "float64-rank3": lambda n: torch.randn(n, 2, 3, dtype=torch.float64),
    "float16-rank2": lambda n: torch.randn(n, 5).half(),
    "bfloat16-rank2": lambda n: torch.randn(n, 4).bfloat16(),
    "int8-rank2": lambda n: torch.randint(-128, 127, (n, 3), dtype=torch.int8),
    "int32-rank1": lambda n: torch.randint(0, 1000, (n,), dtype=torch.int32),
    "int64-rank4": lambda n: torch.randint(0, 50_000, (n, 2, 2, 3)),
    "uint8-rank2": lambda n: torch.randint(0, 255, (n, 6), dtype=torch.uint8),
    "bool-rank2": lambda n: torch.rand(n, 3) > 0.5,
    "complex64-rank1": lambda n: torch.randn(n, dtype=torch.complex64),
    "zero-width": lambda n: torch.empty(n, 0),
}


def round_trips(b: Batch) -> list[Batch]:
    """The same rows back through every row operation."""
    n = len(b)
    perm = torch.randperm(n)
    padded, pad = b.pad_to_divisor(4)
    return [
        Batch.concat(b.chunk(3)),
        Batch.concat(b.split([1, n - 1])),
        b[perm][torch.argsort(perm)],
        b.repeat(3)[::3],
        b.repeat(2, interleave=False)[:n],
        padded.unpad(pad),
        b.select().union(b.select(tensor_keys=[], non_tensor_keys=[])),
        b.to("cpu").contiguous(),
        b[torch.ones(n, dtype=torch.bool)],
        b[::-1][::-1],
    ]


@pytest.mark.parametrize("kind", sorted(TENSOR_COLUMNS))
def test_tensor_column_round_trips(kind: str) -> None:
    b = Batch({"col": TENSOR_COLUMNS[kind](7)}, meta={"kind": kind})
    for out in round_trips(b):
        assert out.tensors["col"].dtype == b.tensors["col"].dtype
        assert out.tensors["col"].shape == b.tensors["col"].shape
        assert out.equals(b), kind


def test_non_tensor_column_round_trips_keep_the_same_objects() -> None:
    shared = {"answer": 42}
    values: list[Any] = ["text", "", 7, None, shared, [1, 2], 2.5]
    b = Batch(non_tensor={"v": values, "uid": list(range(7))})
    for out in round_trips(b):
        assert out["v"] == values
        assert out["v"][4] is shared  # shallow: per-row objects are shared, not copied
    assert b["v"] is not values  # but the batch owns its list


# -- property tests ------------------------------------------------------------------------


@fast
@given(batches(), st.integers(1, 20))
def test_concat_of_chunks_is_the_original(b: Batch, n: int) -> None:
    chunks = b.chunk(n)
    assert [len(c) for c in chunks] == [hi - lo for lo, hi in chunk_bounds(len(b), n)]
    assert Batch.concat(chunks).equals(b)


@fast
@given(batches(), st.lists(st.integers(0, 5), max_size=6))
def test_concat_of_split_is_the_original(b: Batch, sizes: list[int]) -> None:
    sizes = [*sizes, len(b) - sum(sizes)] if sum(sizes) <= len(b) else [len(b)]
    parts = b.split(sizes)
    assert [len(p) for p in parts] == sizes
    assert Batch.concat(parts).equals(b)


@fast
@given(batches(), st.integers(1, 4))
def test_interleaved_repeat_then_every_kth_row_is_the_original(b: Batch, k: int) -> None:
    r = b.repeat(k, interleave=True)
    assert len(r) == k * len(b)
    assert r["uid"] == [u for u in b["uid"] for _ in range(k)]
    for offset in range(k):
        assert r[offset::k].equals(b)


@fast
@given(batches(), st.integers(1, 4))
def test_tiled_repeat_is_concat_of_copies(b: Batch, k: int) -> None:
    assert b.repeat(k, interleave=False).equals(Batch.concat([b] * k))


@fast
@given(batches(), st.integers(1, 20))
def test_pad_to_divisor_then_unpad_is_the_original(b: Batch, d: int) -> None:
    padded, pad = b.pad_to_divisor(d)
    assert len(padded) % d == 0
    assert 0 <= pad < d
    assert len(padded) == len(b) + pad
    assert padded["uid"][len(b) :] == [b["uid"][i % len(b)] for i in range(pad)]  # cyclic from the first rows
    assert padded.unpad(pad).equals(b)


@fast
@given(batches().flatmap(lambda b: st.tuples(st.just(b), st.permutations(range(len(b))))))
def test_permutation_then_inverse_is_the_original(case: tuple[Batch, list[int]]) -> None:
    b, perm = case
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    shuffled = b[perm]
    assert shuffled["uid"] == [b["uid"][p] for p in perm]
    assert shuffled[inverse].equals(b)
    assert b[torch.tensor(perm, dtype=torch.long)][torch.tensor(inverse)].equals(b)


@fast
@given(batches())
def test_mask_selects_rows_in_order(b: Batch) -> None:
    mask = b.tensors["mask"]
    kept, dropped = b[mask], b[~mask]
    assert len(kept) + len(dropped) == len(b)
    assert kept["uid"] == [u for u, m in zip(b["uid"], mask.tolist(), strict=True) if m]
    assert bool(kept.tensors["mask"].all()) and not bool(dropped.tensors["mask"].any())


# -- columns, indexing, helpers ------------------------------------------------------------


def test_empty_batch() -> None:
    empty = Batch()
    assert len(empty) == 0 and empty.keys() == [] and empty.nbytes == 0
    assert Batch.from_dict(meta={"a": 1}).meta == {"a": 1}
    assert len(Batch.concat(empty.chunk(3))) == 0
    assert empty.pad_to_divisor(4)[1] == 0


def test_columns_get_set_contains() -> None:
    b = small()
    assert len(b) == 4 and b.keys() == ["x", "m"]
    assert "x" in b and "s" in b and "k" not in b
    assert b["s"] == ["a", "b", "c", "d"]
    b["y"] = torch.zeros(4, 3)
    b["s"] = torch.ones(4)  # a column may change kind
    assert b.keys() == ["x", "m", "y", "s"] and "s" not in b.non_tensor
    only = Batch({"x": torch.zeros(2)})
    only["x"] = torch.zeros(5)  # replacing the only column may change the row count
    assert len(only) == 5
    empty = Batch()
    empty["ids"] = ["p", "q"]
    assert len(empty) == 2


def test_slices_are_views_and_index_lists_copy() -> None:
    b = small()
    view = b[1:3]
    assert view.tensors["x"].data_ptr() == b.tensors["x"][1].data_ptr()
    storage = b.tensors["x"].untyped_storage().data_ptr()
    assert all(c.tensors["x"].untyped_storage().data_ptr() == storage for c in [*b.chunk(3), *b.split([1, 3])])
    assert b[::2]["s"] == ["a", "c"] and b[::-1]["s"] == ["d", "c", "b", "a"]
    picked = b[[0, 3, 2]]
    assert picked["s"] == ["a", "d", "c"] and picked.tensors["x"].tolist() == [[0, 1], [6, 7], [4, 5]]
    assert picked.tensors["x"].data_ptr() != b.tensors["x"].data_ptr()
    assert b[[-1]]["s"] == ["d"] and len(b[[]]) == 0 and len(b[torch.tensor([])]) == 0
    assert b[[True, False, False, True]]["s"] == ["a", "d"]
    assert b[torch.tensor([2, 0], dtype=torch.int32)]["s"] == ["c", "a"]


def test_select_and_union() -> None:
    b = small()
    s = b.select(tensor_keys=["x"], non_tensor_keys=[], meta_keys=[])
    assert s.keys() == ["x"] and dict(s.non_tensor) == {} and s.meta == {}
    other = Batch({"x": b.tensors["x"].clone(), "z": torch.ones(4)}, {"s": list("abcd")}, {"k": 1, "j": 2})
    u = b.union(other)
    assert u.keys() == ["x", "m", "z"] and u.meta == {"k": 1, "j": 2} and u["s"] == list("abcd")
    assert b.keys() == ["x", "m"]  # inputs untouched
    assert b.union(Batch(meta={"extra": True})).meta == {"k": 1, "extra": True}  # meta-only fits any rows


def test_concat_keeps_first_meta_and_checks_nothing_of_it() -> None:
    a, c = small(), small()
    c.meta = {"k": 2, "timing": 0.1}
    assert Batch.concat([a, c]).meta == {"k": 1}


def test_nbytes_equals_repr_and_repeat_zero() -> None:
    b = small()
    assert b.nbytes == 4 * 2 * 8 + 4 * 1
    assert b[:2].nbytes == 2 * 2 * 8 + 2
    assert repr(b) == "Batch(rows=4, tensors={x: (4, 2) int64, m: (4,) bool}, non_tensor=['s'], meta=['k'])"
    assert len(b.repeat(0)) == 0
    assert not b.equals(small().select(meta_keys=[]))
    assert not b.equals(Batch({"x": b.tensors["x"].float(), "m": b.tensors["m"]}, {"s": list("abcd")}, {"k": 1}))
    assert not b.equals("not a batch")


# -- errors --------------------------------------------------------------------------------


def test_construction_errors_name_the_column_and_both_lengths() -> None:
    with pytest.raises(ValueError, match=r"column 'b' has 3 rows but column 'a' has 2"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"column 's' has 1 rows but column 'a' has 2"):
        Batch({"a": torch.zeros(2)}, {"s": ["x"]})
    with pytest.raises(ValueError, match=r"'a' is both a tensor and a non-tensor column"):
        Batch({"a": torch.zeros(2)}, {"a": [1, 2]})
    with pytest.raises(ValueError, match=r"'a' is 0-dimensional"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"non-tensor column 's' is a tuple, not a list"):
        Batch(non_tensor={"s": ("x",)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"tensor column 'a' is a list, not a torch.Tensor"):
        Batch({"a": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"non-tensor column 's' must be a sequence"):
        Batch.from_dict(non_tensor={"s": "abc"})


def test_setitem_checks_rows_and_type() -> None:
    b = small()
    with pytest.raises(ValueError, match=r"column 'y' has 3 rows but the batch has 4"):
        b["y"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"column 's' has 5 rows but the batch has 4"):
        b["s"] = list("abcde")
    with pytest.raises(TypeError, match=r"column 'y': a torch.Tensor or a list, not tuple"):
        b["y"] = (1, 2, 3, 4)  # type: ignore[assignment]
    assert b.keys() == ["x", "m"] and b["s"] == list("abcd")  # a failed set changes nothing


def test_lookup_and_select_errors() -> None:
    b = small()
    with pytest.raises(KeyError, match=r"no column 'nope'"):
        b["nope"]
    with pytest.raises(KeyError, match=r"no tensor column 'nope'"):
        b.select(tensor_keys=["x", "nope"])
    with pytest.raises(KeyError, match=r"no meta key 'nope'"):
        b.select(meta_keys=["nope"])
    with pytest.raises(TypeError, match=r"list of non-tensor column names, not the string 's'"):
        b.select(non_tensor_keys="s")


def test_union_errors() -> None:
    b = small()
    with pytest.raises(ValueError, match=r"union: the batches have 4 and 2 rows"):
        b.union(b[:2])
    with pytest.raises(ValueError, match=r"union: tensor column 'x' differs"):
        b.union(Batch({"x": torch.zeros(4, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match=r"union: non-tensor column 's' differs"):
        b.union(Batch(non_tensor={"s": list("abcz")}))
    with pytest.raises(ValueError, match=r"union: meta key 'k' differs"):
        b.union(Batch(meta={"k": 2}))


def test_concat_errors() -> None:
    b = small()
    with pytest.raises(ValueError, match=r"at least one batch"):
        Batch.concat([])
    with pytest.raises(
        ValueError, match=r"batch 1 tensor columns differ from batch 0's \(missing \['m'\], extra \[\]\)"
    ):
        Batch.concat([b, b.select(tensor_keys=["x"])])
    with pytest.raises(ValueError, match=r"batch 2 non-tensor columns differ .*extra \['t'\]"):
        Batch.concat([b, b, b.union(Batch(non_tensor={"t": [0] * 4}))])
    bad = Batch({"x": b.tensors["x"].float(), "m": b.tensors["m"]}, {"s": list("abcd")})
    with pytest.raises(ValueError, match=r"column 'x' has rows of \(2,\) torch.float32 in batch 1"):
        Batch.concat([b, bad])


def test_row_operation_errors() -> None:
    b = small()
    with pytest.raises(ValueError, match=r"chunk needs n >= 1, got 0"):
        b.chunk(0)
    with pytest.raises(ValueError, match=r"split sizes \[1, 2\] do not add up to the batch's 4 rows"):
        b.split([1, 2])
    with pytest.raises(ValueError, match=r"split sizes \[5, -1\]"):
        b.split([5, -1])
    with pytest.raises(ValueError, match=r"repeat needs times >= 0"):
        b.repeat(-1)
    with pytest.raises(ValueError, match=r"divisor >= 1, got 0"):
        b.pad_to_divisor(0)
    with pytest.raises(ValueError, match=r"unpad\(5\) on a batch of 4 rows"):
        b.unpad(5)


def test_indexing_errors() -> None:
    b = small()
    with pytest.raises(TypeError, match=r"not an int"):
        b[0]  # type: ignore[call-overload]
    with pytest.raises(IndexError, match=r"row index 4 is out of range for a batch of 4 rows"):
        b[[0, 4]]
    with pytest.raises(IndexError, match=r"row index -5 is out of range"):
        b[torch.tensor([-5])]
    with pytest.raises(ValueError, match=r"bool mask has 3 entries but the batch has 4 rows"):
        b[torch.tensor([True, False, True])]
    with pytest.raises(TypeError, match=r"integer or bool, not torch.float32"):
        b[torch.tensor([0.0])]
    with pytest.raises(ValueError, match=r"must be 1-D, got shape \(2, 2\)"):
        b[torch.tensor([[0, 1], [2, 3]])]
    with pytest.raises(TypeError):
        b[[0.5]]  # type: ignore[list-item]
