"""The probe role: a diagnostic daemon that makes, reshards and inspects tensors and batches.

It exercises the tensor plane (handles, transfers, dispatch across data-parallel sizes) without
any model, for tests and `hfrt bench transfer`. It knows nothing of RL.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hfrt.daemon.base import Daemon
from hfrt.daemon.batch import Batch
from hfrt.protocols import TensorHandle
from hfrt.wire.endpoints import Dispatch, endpoint


class ProbeDaemon(Daemon):
    """Tensors and batches without a model: make, reshard, inspect (and what the last inspect saw)."""

    async def setup(self) -> None:
        torch.set_num_threads(int(self.context.options.get("threads", 1)))
        self.seen: list[int] = []  # row ids the last `inspect` received on this rank

    @endpoint(dispatch=Dispatch.SPLIT)
    def make(self, row_ids: list[int], width: int = 4) -> Batch:
        """A batch whose row r holds r everywhere, so row order can be checked after any reshard."""
        ids = torch.tensor(row_ids, dtype=torch.int64)
        x = ids.to(torch.float32).unsqueeze(1).repeat(1, width)
        return Batch(
            {"ids": ids, "x": x, "half": x.to(torch.bfloat16), "odd": ids % 2 == 1},
            {"text": [f"row {r}" for r in row_ids], "made_by": [self.context.rank] * len(row_ids)},
            {"width": width},
        )

    @endpoint(dispatch=Dispatch.SPLIT)
    def make_from(self, rows: Batch) -> Batch:
        """`make` from a batch whose non-tensor column `ids_list` holds the row ids."""
        return self.make(list(rows.non_tensor["ids_list"]))

    @endpoint(dispatch=Dispatch.SPLIT)
    def reshard(self, batch: Batch) -> Batch:
        """Take my rows of a batch (pulled from wherever they live) and own them from now on."""
        return Batch({k: v.clone() for k, v in batch.tensors.items()}, dict(batch.non_tensor), batch.meta)

    @endpoint(dispatch=Dispatch.SPLIT)
    def inspect(self, batch: Batch) -> list[dict[str, Any]]:
        """One summary per row received: what this rank saw (also kept for `last_seen`)."""
        ids, x, text = batch.tensors["ids"].tolist(), batch.tensors["x"], batch.non_tensor["text"]
        self.seen = ids
        return [{"rank": self.context.rank, "id": i, "x0": float(x[n, 0]), "text": text[n]} for n, i in enumerate(ids)]

    @endpoint
    def last_seen(self) -> list[int]:
        """Row ids of the batch the last `inspect` call received on this rank."""
        return list(self.seen)

    @endpoint
    def tensor(self, nbytes: int, device: str = "cpu") -> torch.Tensor:
        t = torch.arange(nbytes // 4, dtype=torch.float32).reshape(-1, 256) if nbytes >= 1024 else torch.ones(nbytes // 4)
        return t.to(device)

    @endpoint
    def cuda_tensor(self, nbytes: int) -> torch.Tensor:
        """Like `tensor`, on this daemon's CUDA device (GPU tests)."""
        return self.tensor(nbytes, "cuda")

    @endpoint
    def total(self, t: torch.Tensor) -> float:
        return float(t.double().sum())

    @endpoint(raw_handles=True)
    def timed_pull(self, handle: TensorHandle, backend: str | None = None, repeats: int = 3) -> dict[str, Any]:
        """Seconds to pull `handle` into a preallocated tensor here, per repeat, and the backend used."""
        plane = self.tensor_plane()
        dest = torch.empty((handle.num_rows, *handle.shape[1:]), dtype=torch.float32, device=handle.device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            [pulled] = plane.peers.pull([handle], force=backend)
            dest.copy_(pulled)
            _sync(handle.device)
            times.append(time.perf_counter() - start)
            del pulled
        return {"seconds": times, "backend": backend or plane.peers.backend_for(handle)}

    @endpoint
    def gpus(self) -> int:
        return torch.cuda.device_count()

    @endpoint
    def memcpy(self, nbytes: int, repeats: int = 3, device: str = "cpu") -> list[float]:
        """Seconds to copy nbytes into a preallocated tensor in this process: the physical reference."""
        src = torch.rand(nbytes // 4, device=device)
        dest = torch.empty_like(src)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dest.copy_(src)
            _sync(device)
            times.append(time.perf_counter() - start)
        return times


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
