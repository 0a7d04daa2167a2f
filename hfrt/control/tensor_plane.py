"""The controller's side of the tensor plane, mixed into Controller: the peer directory, batched
frees, fetching handles on purpose, per-daemon stats, and forming the distributed data-plane group.

It uses the controller's submit() and registry; it never touches tensor bytes except in `fetch`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from hfrt.wire.errors import DaemonGone

if TYPE_CHECKING:
    from hfrt.control.daemons import DaemonInfo
    from hfrt.control.lifetimes import HandleTracker


class TensorPlaneControl:
    """Needs from its host class: submit, daemons, count_bulk_bytes, _daemons, _plane_ranks,
    _handles, _stats."""

    _daemons: dict[str, DaemonInfo]
    _plane_ranks: dict[str, int]
    _handles: HandleTracker
    _stats: dict[str, int]

    if TYPE_CHECKING:
        def submit(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                   timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]: ...
        def daemons(self, role: str | None = None) -> list[DaemonInfo]: ...
        def count_bulk_bytes(self, nbytes: int) -> None: ...

    def _directory(self) -> dict[str, dict[str, Any]]:
        return {
            d.identity: {**{k: d.meta.get(k) for k in ("data", "host", "pid")}, "plane_rank": self._plane_ranks.get(d.identity, -1)}
            for d in self._daemons.values()
            if d.alive and d.meta.get("data")
        }

    def _push_directory(self) -> None:
        """Tell every daemon where every daemon's data plane is (sent before any handle of a
        newcomer can reach anyone, since it goes out as the newcomer is welcomed)."""
        directory = self._directory()
        for info in self._daemons.values():
            if info.alive:
                self.submit(info, "_hfrt_peers", [directory], {}, reply=False)

    def _free_keys(self, owner: str, keys: list[str]) -> None:
        info = self._daemons.get(owner)
        if info is not None and info.alive:
            self.submit(info, "_hfrt_free", [keys], {}, reply=False)
            self._stats["keys_freed"] += len(keys)

    def free_now(self) -> None:
        """Send the frees of handles dropped so far right away (normally they go on the next loop turn)."""
        import gc

        gc.collect()
        self._handles.flush()

    async def fetch(self, value: Any) -> Any:
        """Materialise a TensorHandle (→ torch.Tensor) or BatchHandle (→ hfrt.daemon.batch.Batch) here.

        For debugging and small controller-side math: the bytes come through the controller and
        are counted in stats()["controller_bulk_bytes"]. Imports torch on first use.
        """
        from hfrt.control.fetch import batch_from, tensor_from
        from hfrt.protocols import BatchHandle, TensorHandle

        if isinstance(value, TensorHandle):
            [buf] = await self._fetch_bytes(value.owner, [value])
            return tensor_from(buf, value)
        if isinstance(value, BatchHandle):
            parts = []
            for shard in value.shards:
                bufs = await self._fetch_bytes(shard.owner, list(shard.columns.values()))
                parts.append((shard, bufs))
            return batch_from(value, parts)
        raise TypeError(f"fetch takes a TensorHandle or BatchHandle, not {type(value).__name__}")

    async def _fetch_bytes(self, owner: str, handles: list[Any]) -> list[Any]:
        info = self._daemons.get(owner)
        if info is None:
            raise DaemonGone(f"no daemon {owner!r} holds these tensors")
        buffers = await self.submit(info, "_hfrt_fetch", [handles], {})
        self.count_bulk_bytes(sum(len(b.buffer) for b in buffers))
        return list(buffers)

    async def daemon_stats(self, role: str | None = None) -> dict[str, Any]:
        """Per-daemon tensor-plane figures: store size, bytes pulled per backend, bytes served."""
        infos = [d for d in self.daemons(role) if d.alive]
        results = await asyncio.gather(*(self.submit(d, "_hfrt_stats", [], {}) for d in infos))
        return {d.identity: r for d, r in zip(infos, results, strict=True)}

    async def form_data_plane(self, backend: str = "gloo", *, timeout_s: float = 120.0) -> dict[str, int]:
        """Join every live daemon into one torch.distributed group for daemon-to-daemon transfers
        (gloo on CPU, nccl on GPU); afterwards pulls between hosts use it. Returns the ranks."""
        infos = sorted((d for d in self._daemons.values() if d.alive), key=lambda d: d.identity)
        if not infos:
            raise RuntimeError("no daemons to form a data plane with")
        world = len(infos)
        master = await self.submit(infos[0], "_hfrt_plane_open", [world], {}, timeout_s=timeout_s)
        joins = [self.submit(d, "_hfrt_plane_join", [master, world, r, backend], {}, timeout_s=timeout_s) for r, d in enumerate(infos)]
        await asyncio.gather(*joins)
        self._plane_ranks = {d.identity: r for r, d in enumerate(infos)}
        self._push_directory()
        return dict(self._plane_ranks)
