"""The controller's side of the tensor plane, an object the Controller owns: the peer directory
(where each daemon's data plane is, and which daemon is told which entries, when), freeing the daemon tensors of handles
the flow dropped, fetching handles on purpose, per-daemon figures, and forming the distributed
data-plane group.

It is given a way to send one call to one daemon (`Submit`: the controller's submit), a view of
the registry (every daemon that said hello, and one by identity) and the controller's counters.
It never touches tensor bytes except in `fetch`; it knows nothing of sockets, nor of how calls
are routed, answered or timed out.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from hfrt.control.lifetimes import HandleTracker
from hfrt.protocols import BatchHandle, TensorHandle
from hfrt.protocols.handles import INLINE_OWNER
from hfrt.wire.errors import DaemonGone

if TYPE_CHECKING:
    from hfrt.control.daemons import DaemonInfo

#: what a daemon's hello declares (its meta) that the directory passes on: data-plane address, host, pid
DIRECTORY_FIELDS = ("data", "host", "pid")
#: the internal call that tells a daemon directory entries (hfrt.daemon.tensor_serving answers it)
DIRECTORY_CALL = "_hfrt_peers"


class Submit(Protocol):
    """Send one call to one daemon now; the future resolves with its reply value (Controller.submit)."""

    def __call__(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                 timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]: ...


class PeerDirectory:
    """Where every daemon's data plane is, and who has been told what.

    A daemon is told the entries it needs when it first needs them: before a call that names
    handles of owners it has not been told of goes out, it gets one directory message with just
    those entries (`introduce`; the call follows it on the same ordered channel). A start-up sends
    nothing, and a run sends each daemon the entries of the owners whose handles it is actually
    given — a few per rank in a PPO-style flow (the rows its data-parallel peers made, rank 0's
    whole-batch results), N² entries only for traffic that really is all-to-all; pushing the whole
    directory to everyone on every join sent N² entries per start-up, N³ bytes. When a known
    identity comes back as a new process, whoever was told of the old one gets the new entry and
    the newcomer starts knowing nothing; when the data-plane group is formed, every daemon gets
    its known entries again with their group ranks. This class alone decides what goes to whom.

    daemon: one daemon that said hello, by identity (None: unknown); daemons: all of them.
    submit: sends one call (here: DIRECTORY_CALL, without waiting for a reply).
    """

    def __init__(self, daemon: Callable[[str], DaemonInfo | None], daemons: Callable[[], Iterable[DaemonInfo]],
                 submit: Submit) -> None:
        self._daemon = daemon
        self._daemons = daemons
        self._submit = submit
        self._told: dict[str, set[str]] = {}  # recipient → owners whose entries it has
        self._told_of: dict[str, set[str]] = {}  # owner → recipients that have its entry
        #: identity → rank in the distributed data-plane group (empty until one is formed)
        self.plane_ranks: dict[str, int] = {}

    def entry(self, info: DaemonInfo) -> dict[str, Any]:
        """{data, host, pid, plane_rank} of one daemon (plane_rank -1: not in a formed group)."""
        return {**{k: info.meta.get(k) for k in DIRECTORY_FIELDS}, "plane_rank": self.plane_ranks.get(info.identity, -1)}

    def entries(self) -> dict[str, dict[str, Any]]:
        """identity → entry of every live daemon with a data plane."""
        return {d.identity: self.entry(d) for d in self._daemons() if d.alive and d.meta.get("data")}

    def told(self, recipient: str) -> set[str]:
        """The owners whose entries `recipient` has been told."""
        return set(self._told.get(recipient, ()))

    def introduce(self, recipient: DaemonInfo, records: Iterable[Any]) -> None:
        """A call to `recipient` names `records` (handles): first tell it the entries of their
        owners it lacks (it needs none for itself or inline rows). A gone owner's last entry is
        told too: the daemon's pull then fails saying that owner is gone, not that it is unknown."""
        told = self._told.setdefault(recipient.identity, set())
        new: dict[str, dict[str, Any]] = {}
        for owner in _owners(records):
            if owner in told or owner in new or owner == recipient.identity:
                continue
            info = self._daemon(owner)
            if info is not None and info.meta.get("data"):
                new[owner] = self.entry(info)
        if new:
            self._tell(recipient, new)

    def joined(self, info: DaemonInfo) -> None:
        """`info` said hello as a new process. Called as it is welcomed, before any call can name
        its handles: it knows no entries yet, and whoever knew an earlier process of its identity
        gets its new entry."""
        for owner in self._told.pop(info.identity, set()):
            self._told_of.get(owner, set()).discard(info.identity)
        if not info.meta.get("data"):
            return
        update = {info.identity: self.entry(info)}
        for identity in sorted(self._told_of.get(info.identity, ())):
            recipient = self._daemon(identity)
            if recipient is not None and recipient.alive:
                self._submit(recipient, DIRECTORY_CALL, [update], {}, reply=False)

    def formed(self, ranks: dict[str, int]) -> None:
        """The data-plane group was formed with these ranks; every live daemon gets the entries it
        knows again, with their ranks (later introductions carry them)."""
        self.plane_ranks = dict(ranks)
        for recipient in self._daemons():
            known = [self._daemon(owner) for owner in sorted(self._told.get(recipient.identity, ()))]
            update = {o.identity: self.entry(o) for o in known if o is not None and o.alive}
            if recipient.alive and update:
                self._submit(recipient, DIRECTORY_CALL, [update], {}, reply=False)

    def _tell(self, recipient: DaemonInfo, entries: dict[str, dict[str, Any]]) -> None:
        self._told[recipient.identity].update(entries)
        for owner in entries:
            self._told_of.setdefault(owner, set()).add(recipient.identity)
        self._submit(recipient, DIRECTORY_CALL, [entries], {}, reply=False)


def _owners(records: Iterable[Any]) -> Iterator[str]:
    """The owning daemons of handle records, in order, repeats included (inline rows have none)."""
    for record in records:
        if isinstance(record, BatchHandle):
            for shard in record.shards:
                if shard.owner != INLINE_OWNER:
                    yield shard.owner
        elif isinstance(record, TensorHandle):
            yield record.owner


class TensorPlane:
    """The controller's tensor-plane calls (see the module docstring).

    daemons: every daemon that said hello (alive or not); daemon: one by identity (None: unknown).
    submit: sends one call to one daemon now. stats: the controller's counters, where this adds
    `keys_freed` and `controller_bulk_bytes`.
    """

    def __init__(self, daemons: Callable[[], Iterable[DaemonInfo]], daemon: Callable[[str], DaemonInfo | None],
                 submit: Submit, stats: dict[str, int]) -> None:
        self.directory = PeerDirectory(daemon, daemons, submit)
        self._daemons = daemons
        self._daemon = daemon
        self._submit = submit
        self._stats = stats
        self._handles: HandleTracker | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin tracking handles; frees are sent on `loop`."""
        self._handles = HandleTracker(loop, self._free_keys)

    def joined(self, info: DaemonInfo) -> None:
        """A new daemon process said hello (see PeerDirectory.joined)."""
        self.directory.joined(info)

    def introduce(self, recipient: DaemonInfo, records: list[Any]) -> None:
        """A call to `recipient` names these handle records: it gets the directory entries of
        their owners it lacks first (see PeerDirectory.introduce)."""
        self.directory.introduce(recipient, records)

    def track(self, value: Any) -> None:
        """Hold every handle in a freshly decoded reply value; when the flow drops the last one
        naming a key, the key's owner is told to free it."""
        assert self._handles is not None, "tensor plane not started"
        self._handles.track(value)

    @property
    def live_keys(self) -> int:
        """Daemon tensor keys some handle in this process still names."""
        return self._handles.live_keys if self._handles is not None else 0

    def count_bulk_bytes(self, nbytes: int) -> None:
        """Record tensor payload bytes that were materialised in the controller on purpose."""
        self._stats["controller_bulk_bytes"] += nbytes

    def _free_keys(self, owner: str, keys: list[str]) -> None:
        info = self._daemon(owner)
        if info is not None and info.alive:
            self._submit(info, "_hfrt_free", [keys], {}, reply=False)
            self._stats["keys_freed"] += len(keys)

    def free_now(self) -> None:
        """Send the frees of handles dropped so far right away (normally they go on the next loop turn)."""
        gc.collect()
        if self._handles is not None:
            self._handles.flush()

    async def fetch(self, value: Any) -> Any:
        """Materialise a TensorHandle (→ torch.Tensor) or BatchHandle (→ hfrt.daemon.batch.Batch) here.

        For debugging and small controller-side math: the bytes come through the controller and
        are counted as controller_bulk_bytes. Imports torch on first use.
        """
        from hfrt.control.fetch import batch_from, tensor_from

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
        info = self._daemon(owner)
        if info is None:
            raise DaemonGone(f"no daemon {owner!r} holds these tensors")
        buffers = await self._submit(info, "_hfrt_fetch", [handles], {})
        self.count_bulk_bytes(sum(len(b.buffer) for b in buffers))
        return list(buffers)

    async def daemon_stats(self, role: str | None = None) -> dict[str, Any]:
        """Per-daemon tensor-plane figures (store size, bytes pulled per backend, bytes served) of
        the live daemons of `role` (None: all), by identity."""
        infos = sorted((d for d in self._daemons() if d.alive and (role is None or d.role == role)),
                       key=lambda d: (d.role, d.rank))
        results = await asyncio.gather(*(self._submit(d, "_hfrt_stats", [], {}) for d in infos))
        return {d.identity: r for d, r in zip(infos, results, strict=True)}

    async def form_data_plane(self, backend: str = "gloo", *, timeout_s: float = 120.0) -> dict[str, int]:
        """Join every live daemon into one torch.distributed group for daemon-to-daemon transfers
        (gloo on CPU, nccl on GPU); afterwards pulls between hosts use it. Returns the ranks."""
        infos = sorted((d for d in self._daemons() if d.alive), key=lambda d: d.identity)
        if not infos:
            raise RuntimeError("no daemons to form a data plane with")
        world = len(infos)
        master = await self._submit(infos[0], "_hfrt_plane_open", [world], {}, timeout_s=timeout_s)
        joins = [self._submit(d, "_hfrt_plane_join", [master, world, r, backend], {}, timeout_s=timeout_s)
                 for r, d in enumerate(infos)]
        await asyncio.gather(*joins)
        ranks = {d.identity: r for r, d in enumerate(infos)}
        self.directory.formed(ranks)
        return ranks
