"""Tensors in named /dev/shm files: written once by their owner, mapped by readers on the same host.

A file is a 4 KiB header (magic, dtype, shape, nbytes as msgpack) followed by the tensor's bytes,
so a reader maps only the page window holding the rows it wants, privately (copy-on-write: the
reader may write to its tensor without touching the owner's), and checks the header against its
handle. Pages are not pre-populated: MAP_POPULATE on a private writable mapping pre-faults every
page for writing, which copies them all (measured: 3x slower than faulting on first read). It knows nothing of keys' lifetimes or
of sockets. File names, and removing the files of dead daemons, are hfrt.wire.shm's (torch-free).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import msgpack
import torch

from hfrt.wire.shm import SHM_DIR as SHM_DIR
from hfrt.wire.shm import path_for as path_for
from hfrt.wire.shm import remove_stale as remove_stale

HEADER = 4096
MAGIC = b"HFRTSHM1"
PAGE = mmap.PAGESIZE

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r}") from None


def write(path: Path, tensor: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """Copy a CPU tensor into a new shm file; return a tensor viewing the file and its mapping."""
    src = tensor.detach().contiguous()
    nbytes = src.numel() * src.element_size()
    header = msgpack.packb([MAGIC, dtype_name(src.dtype), list(src.shape), nbytes])
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, HEADER + max(nbytes, 1))
        mm = mmap.mmap(fd, HEADER + max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mm[: len(header)] = header
    view = _view(mm, HEADER, src.dtype, tuple(src.shape), nbytes)
    view.copy_(src)
    return view, mm


def read_header(path: Path) -> tuple[str, tuple[int, ...], int]:
    with open(path, "rb") as f:
        raw = f.read(HEADER)
    try:
        magic, dtype, shape, nbytes = _first_value(raw)
    except (ValueError, TypeError):
        raise ValueError(f"{path} is not an hfrt tensor file") from None
    if magic != MAGIC:
        raise ValueError(f"{path} is not an hfrt tensor file")
    return dtype, tuple(shape), nbytes


def _first_value(raw: bytes) -> Any:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(raw)
    return next(unpacker)


def map_rows(path: Path, dtype: torch.dtype, shape: tuple[int, ...], rows: tuple[int, int]) -> torch.Tensor:
    """Rows [start, stop) of the file's tensor, mapped copy-on-write: no copy, writes stay private."""
    start, stop = rows
    row_bytes = (_numel(shape[1:]) if shape else 1) * torch.empty((), dtype=dtype).element_size()
    begin = HEADER + start * row_bytes
    length = (stop - start) * row_bytes
    if length == 0:
        return torch.empty((0, *shape[1:]), dtype=dtype)
    window = begin - begin % PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(
            fd, begin + length - window, mmap.MAP_PRIVATE,
            mmap.PROT_READ | mmap.PROT_WRITE, offset=window,
        )
    finally:
        os.close(fd)
    return _view(mm, begin - window, dtype, (stop - start, *shape[1:]), length)


def _view(mm: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
