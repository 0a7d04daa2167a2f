"""The per-daemon tensor store: what this daemon's endpoints produced, by key, until the controller frees it.

CPU tensors are staged once into a named /dev/shm file when stored, so same-host peers map them
without asking. Thread-safe (the data-plane thread reads it). It knows nothing of sockets or of
who asked for a tensor.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from hfrt.daemon.tensors import shmfile
from hfrt.protocols import TensorHandle


class HandleError(LookupError):
    """A handle does not name a tensor this store holds, or does not match it."""


@dataclass
class _Entry:
    tensor: torch.Tensor
    path: Path | None
    mapping: mmap.mmap | None


class TensorStore:
    """put/get/free by key. stage_in_shm: keep CPU tensors in /dev/shm files (for same-host peers)."""

    def __init__(self, owner: str, *, stage_in_shm: bool = True) -> None:
        self.owner = owner
        self.stage_in_shm = stage_in_shm
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def put(self, tensor: torch.Tensor) -> TensorHandle:
        key = f"t{next(self._ids)}"
        path = mapping = None
        stored = tensor.detach()
        if self.stage_in_shm and stored.device.type == "cpu":
            path = shmfile.path_for(self._pid, key)
            stored, mapping = shmfile.write(path, stored)
        elif not stored.is_contiguous():
            stored = stored.contiguous()
        with self._lock:
            self._entries[key] = _Entry(stored, path, mapping)
        return TensorHandle(
            self.owner, key, tuple(stored.shape), shmfile.dtype_name(stored.dtype), str(stored.device),
            stored.numel() * stored.element_size(),
        )

    def get(self, handle: TensorHandle) -> torch.Tensor:
        """The rows the handle selects (a view, no copy), after checking the handle matches."""
        if handle.owner != self.owner:
            raise HandleError(f"handle of {handle.owner} was sent to {self.owner}")
        with self._lock:
            entry = self._entries.get(handle.key)
        if entry is None:
            raise HandleError(f"{self.owner} holds no tensor {handle.key!r} (freed, or never stored here)")
        t = entry.tensor
        if tuple(t.shape) != handle.shape or shmfile.dtype_name(t.dtype) != handle.dtype:
            raise HandleError(
                f"handle {handle.key!r} says {handle.dtype}{list(handle.shape)} but {self.owner} "
                f"stores {shmfile.dtype_name(t.dtype)}{list(t.shape)}"
            )
        lo, hi = handle.row_range
        return t if handle.rows is None else t[lo:hi]

    def free(self, keys: list[str]) -> int:
        """Drop these keys (unknown ones are ignored: frees may race with shutdown). Returns how many."""
        with self._lock:
            entries = [self._entries.pop(k) for k in keys if k in self._entries]
        for entry in entries:
            if entry.path is not None:
                entry.path.unlink(missing_ok=True)
        return len(entries)

    def close(self) -> None:
        with self._lock:
            keys = list(self._entries)
        self.free(keys)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.tensor.numel() * e.tensor.element_size() for e in self._entries.values())
