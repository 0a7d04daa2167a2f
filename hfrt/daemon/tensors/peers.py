"""Pulling tensors from their owners, by the cheapest path that reaches them.

Backends, chosen per handle from where the owner is: `local` (this daemon's own store: a view, no
copy), `shm` (same host, CPU: map the owner's /dev/shm file copy-on-write, no round trip),
`cuda_ipc` (same host, GPU: open the owner's CUDA IPC handle and copy on the device),
`dist` (a torch.distributed point-to-point over the data-plane group: gloo or NCCL), and `zmq`
(bytes over the owner's data-plane socket, the fallback). `HFRT_TRANSFER` (or the `transfer`
daemon option) forces one for testing. Every pull is counted per backend. It knows the store,
the directory of peers and the wire; it knows nothing of endpoints.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from hfrt.daemon.tensors import shmfile
from hfrt.daemon.tensors.distplane import Group
from hfrt.daemon.tensors.store import HandleError, TensorStore
from hfrt.log import get_logger
from hfrt.protocols import Call, Error, Limits, OutOfBand, Reply, TensorHandle, Wire
from hfrt.wire import shm

BACKENDS = ("local", "shm", "cuda_ipc", "dist", "zmq")


@dataclass(frozen=True)
class PeerInfo:
    data: str
    host: str
    pid: int
    plane_rank: int = -1


class TransferError(RuntimeError):
    """A tensor could not be pulled from its owner; says which, from whom and why."""


class Peers:
    def __init__(self, me: str, store: TensorStore, key: bytes, *, force: str | None = None, timeout_s: float = 120.0) -> None:
        if force is not None and force not in BACKENDS:
            raise ValueError(f"transfer backend must be one of {', '.join(BACKENDS)}, got {force!r}")
        self.me = me
        self.host = shm.host_id()
        self.store = store
        self.force = force
        self.group: Group | None = None
        self.directory: dict[str, PeerInfo] = {}
        self.stats: dict[str, dict[str, int]] = {b: {"tensors": 0, "bytes": 0} for b in BACKENDS}
        self._key = key
        self._timeout_ms = int(timeout_s * 1000)
        self._wire = Wire(key, Limits(max_frame_bytes=2**31 - 1, max_message_bytes=2**40), sign_buffers=False)
        self._zmq: zmq.Context[Any] = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket[Any]] = {}
        self._ids = itertools.count(1)
        self._tags = itertools.count(1000, 64)
        self._lock = threading.Lock()
        self._log = get_logger(part="peers", daemon=me)

    def update(self, directory: dict[str, dict[str, Any]]) -> None:
        """Add or renew entries (the controller tells each daemon the owners it needs, when it needs them)."""
        self.directory.update({
            name: PeerInfo(str(d["data"]), str(d["host"]), int(d["pid"]), int(d.get("plane_rank", -1)))
            for name, d in directory.items()
        })

    def backend_for(self, handle: TensorHandle, force: str | None = None) -> str:
        force = force or self.force
        if handle.owner == self.me and force is None:
            return "local"
        peer = self._peer(handle.owner)
        same_host = peer.host == self.host and handle.device == "cpu"
        if peer.host == self.host and handle.device.startswith("cuda") and force is None:
            return "cuda_ipc"
        if force is not None:
            if force not in BACKENDS:
                raise ValueError(f"transfer backend must be one of {', '.join(BACKENDS)}, got {force!r}")
            if force == "shm" and not same_host:
                raise TransferError(f"cannot use shm to pull from {handle.owner}: not on this host")
            return force
        if same_host:
            return "shm"
        return "dist" if self.group is not None and peer.plane_rank >= 0 else "zmq"

    def pull(self, handles: Iterable[TensorHandle], force: str | None = None) -> list[torch.Tensor]:
        """The selected rows of each handle, in order. Raises TransferError naming the owner.

        force: use this backend rather than the automatic choice (benchmarks, tests).
        """
        handles = list(handles)
        out: list[torch.Tensor | None] = [None] * len(handles)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, h in enumerate(handles):
            groups.setdefault((self.backend_for(h, force), h.owner), []).append(i)
        for (backend, owner), idx in groups.items():
            try:
                tensors = getattr(self, f"_pull_{backend}")(owner, [handles[i] for i in idx])
            except (HandleError, TransferError) as exc:
                raise TransferError(f"{self.me} could not pull from {owner} via {backend}: {exc}") from None
            except (OSError, ValueError, RuntimeError) as exc:
                raise TransferError(f"{self.me} could not pull from {owner} via {backend}: {type(exc).__name__}: {exc}") from None
            for i, t in zip(idx, tensors, strict=True):
                out[i] = t
            self._log.debug("pulled", backend=backend, owner=owner, tensors=len(idx))
            stat = self.stats[backend]
            stat["tensors"] += len(idx)
            stat["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return [t for t in out if t is not None]

    # -- backends -----------------------------------------------------------------------------

    def _pull_local(self, owner: str, handles: list[TensorHandle]) -> list[torch.Tensor]:
        return [self.store.get(h) for h in handles]

    def _pull_shm(self, owner: str, handles: list[TensorHandle]) -> list[torch.Tensor]:
        peer = self._peer(owner)
        out = []
        for h in handles:
            path = shmfile.path_for(peer.pid, h.key)
            try:
                dtype, shape, nbytes = shmfile.read_header(path)
                if (dtype, shape, nbytes) != (h.dtype, h.shape, h.nbytes):
                    raise HandleError(f"handle {h.key!r} says {h.dtype}{list(h.shape)} but {owner} stores {dtype}{list(shape)}")
                out.append(shmfile.map_rows(path, shmfile.to_dtype(dtype), shape, h.row_range))
            except FileNotFoundError:  # gone before the header was read, or between header and map
                if not shm.owner_alive(peer.pid):  # killed mid-run: its files went with it
                    raise HandleError(f"{owner} (pid {peer.pid}) is gone: its tensor {h.key!r} went with it") from None
                raise HandleError(f"{owner} holds no tensor {h.key!r} (freed, or never stored there)") from None
        return out

    def _pull_cuda_ipc(self, owner: str, handles: list[TensorHandle]) -> list[torch.Tensor]:
        """Map the owner's CUDA memory through IPC handles and copy the rows into our own tensor
        (the copy lets the owner free its tensor whenever the controller says so)."""
        exports = self._request(owner, "ipc", handles, {})
        out = []
        for (share, offset, stride), h in zip(exports, handles, strict=True):
            storage = torch.UntypedStorage._new_shared_cuda(*share)  # type: ignore[attr-defined]
            whole = torch.empty(0, dtype=shmfile.to_dtype(h.dtype), device=storage.device)
            whole.set_(storage, offset, h.shape, tuple(stride))
            lo, hi = h.row_range
            out.append(whole[lo:hi].clone())
        return out

    def _pull_zmq(self, owner: str, handles: list[TensorHandle]) -> list[torch.Tensor]:
        buffers = self._request(owner, "bytes", handles, {})
        if not isinstance(buffers, list) or len(buffers) != len(handles):
            raise TransferError(f"{owner} answered a bytes request with {type(buffers).__name__}")
        return [_from_bytes(b, h) for b, h in zip(buffers, handles, strict=True)]

    def _pull_dist(self, owner: str, handles: list[TensorHandle]) -> list[torch.Tensor]:
        group, peer = self.group, self._peer(owner)
        if group is None or peer.plane_rank < 0:
            raise TransferError("no distributed data-plane group has been formed (Controller.form_data_plane)")
        tag = next(self._tags)
        bufs = [torch.empty((h.num_rows, *h.shape[1:]), dtype=shmfile.to_dtype(h.dtype), device=h.device) for h in handles]
        with group.lock(peer.plane_rank):  # one transfer at a time per pair keeps send/recv order aligned
            self._request(owner, "send", handles, {"dst": group.rank, "tag": tag})
            for i, buf in enumerate(bufs):
                group.recv(buf, peer.plane_rank, tag + i)
        return bufs

    # -- plumbing -----------------------------------------------------------------------------

    def _peer(self, owner: str) -> PeerInfo:
        peer = self.directory.get(owner)
        if peer is None:
            raise TransferError(f"no daemon named {owner!r} is known to {self.me} (unknown owner, or it is gone)")
        return peer

    def _request(self, owner: str, what: str, handles: list[TensorHandle], kwargs: dict[str, Any]) -> Any:
        with self._lock:
            sock = self._sockets.get(owner)
            if sock is None:
                sock = self._sockets[owner] = self._zmq.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self._peer(owner).data)
            call_id = next(self._ids)
            sock.send_multipart(self._wire.pack(Call(call_id, what, [handles], kwargs, True)))
            while True:
                if not sock.poll(self._timeout_ms):
                    raise TransferError(f"{owner} did not answer within {self._timeout_ms / 1000:.0f}s (is it alive?)")
                frames = sock.recv_multipart(copy=False)  # tensor bytes stay in ZeroMQ's buffers
                msg = self._wire.unpack([frames[0].bytes, *(f.buffer for f in frames[1:])])
                if getattr(msg, "call_id", None) == call_id:
                    break
        if isinstance(msg, Error):
            raise TransferError(f"{msg.type}: {msg.message}")
        assert isinstance(msg, Reply)
        return msg.value

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._sockets.clear()


def _from_bytes(buffer: Any, handle: TensorHandle) -> torch.Tensor:
    data = buffer.buffer if isinstance(buffer, OutOfBand) else buffer
    dtype = shmfile.to_dtype(handle.dtype)
    shape = (handle.num_rows, *handle.shape[1:])
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)  # one copy: writable
    return flat.view(dtype).reshape(shape)
