"""The distributed data-plane group: torch.distributed point-to-point between daemons (gloo on CPU,
NCCL on GPU), built on its own store so it never touches the default process group that a
role's training engine uses. It knows ranks and tensors; it knows nothing of handles or roles.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def open_store(host: str, world: int, timeout_s: float = 120.0) -> tuple[dist.TCPStore, str]:
    """Rank 0 of the data plane hosts the rendezvous store on a free port; returns it and host:port."""
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, f"{host}:{store.port}"


class Group:
    """Point-to-point over a ProcessGroupGloo/NCCL of `world` daemons; sends to one peer are ordered."""

    def __init__(
        self, master: str, world: int, rank: int, backend: str = "gloo", *,
        store: dist.TCPStore | None = None, timeout_s: float = 120.0,
    ) -> None:
        host, port = master.rsplit(":", 1)
        timeout = timedelta(seconds=timeout_s)
        self._store = store or dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore("hfrt-data-plane", self._store)
        self.pg: Any
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, dist.ProcessGroupNCCL.Options())
        else:
            raise ValueError(f"data-plane backend must be gloo or nccl, got {backend!r}")
        self.backend, self.rank, self.world = backend, rank, world
        self._locks: dict[int, threading.Lock] = {}

    def lock(self, peer: int) -> threading.Lock:
        return self._locks.setdefault(peer, threading.Lock())

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.pg.send([tensor], dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self.pg.recv([tensor], src, tag).wait()
