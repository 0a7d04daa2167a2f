"""The data-plane server: a thread that hands this daemon's stored tensors to peers that ask.

It binds its own ROUTER socket and serves requests whatever the daemon's main loop is doing, so
a daemon busy in a long endpoint still serves its outputs (and two daemons pulling from each
other cannot deadlock). Requests are signed Calls: `bytes` (the rows as out-of-band frames) and
`send` (the rows over the torch.distributed data-plane group). It knows the store and the wire;
it knows nothing of endpoints.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING, Any

import zmq

from hfrt.log import get_logger
from hfrt.protocols import Call, Error, Limits, OutOfBand, Reply, TensorHandle, Wire, WireError

if TYPE_CHECKING:
    import torch

    from hfrt.daemon.tensors.store import TensorStore


def as_bytes(tensor: torch.Tensor) -> OutOfBand:
    """A tensor's bytes as an out-of-band frame (a view when the tensor is contiguous)."""
    import torch

    return OutOfBand(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def advertised_host(controller: str) -> str:
    """The local address peers should use: $HFRT_NODE_ADDR (set by the cluster launchers from the
    spec), else the interface that routes to the controller."""
    if os.environ.get("HFRT_NODE_ADDR"):
        return os.environ["HFRT_NODE_ADDR"]
    if not controller.startswith("tcp://"):
        return "127.0.0.1"
    host = controller[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "*", "0.0.0.0"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent; this only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def cuda_ipc_export(tensor: torch.Tensor) -> list[Any]:
    """What a same-host peer needs to map a CUDA tensor's memory: IPC handles (bytes) + layout."""
    share = tensor.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    return [list(share), tensor.storage_offset(), list(tensor.stride())]


class DataPlaneServer(threading.Thread):
    def __init__(self, owner: str, key: bytes, *, host: str, limits: Limits | None = None) -> None:
        super().__init__(name="hfrt-data-plane", daemon=True)
        self.owner = owner
        self.store: TensorStore | None = None  # set once the daemon stores its first tensor
        self._wire = Wire(key, limits or Limits(max_frame_bytes=2**31 - 1, max_message_bytes=2**40), sign_buffers=False)
        self._zmq: zmq.Context[Any] = zmq.Context.instance()
        self._sock = self._zmq.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{'127.0.0.1' if host == '127.0.0.1' else '*'}")
        self.address = f"tcp://{host}:{port}"
        self._stopping = threading.Event()
        self.sender: Any = None  # set when a distributed data-plane group exists (distplane.Group)
        self.served: dict[str, int] = {"bytes": 0, "send": 0, "ipc": 0}
        self._log = get_logger(part="data-plane", owner=owner)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._sock.poll(100):
                    continue
                ident, *frames = self._sock.recv_multipart()
                self._handle(ident, frames)
        finally:
            self._sock.close(linger=0)

    def _handle(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            msg = self._wire.unpack(frames)
        except WireError as exc:
            self._log.warning("dropped_frame", reason=str(exc))
            return
        if not isinstance(msg, Call):
            return
        try:
            handles = [h for h in msg.args[0] if isinstance(h, TensorHandle)]
            if len(handles) != len(msg.args[0]):
                raise ValueError("a data-plane request must list tensor handles")
            if self.store is None:
                raise LookupError(f"{self.owner} holds no tensors")
            tensors = [self.store.get(h) for h in handles]
            if msg.endpoint == "bytes":
                value: Any = [as_bytes(t) for t in tensors]
            elif msg.endpoint == "ipc":
                value = [cuda_ipc_export(t) for t in tensors]
            elif msg.endpoint == "send":
                if self.sender is None:
                    raise RuntimeError(f"{self.owner} has no distributed data-plane group")
                value = None
            else:
                raise ValueError(f"unknown data-plane request {msg.endpoint!r}")
            reply = self._wire.pack(Reply(msg.call_id, value, 0.0))
        except Exception as exc:
            self._sock.send_multipart([ident, *self._wire.pack(Error(msg.call_id, type(exc).__name__, str(exc)))])
            return
        self._sock.send_multipart([ident, *reply], copy=False)
        self.served[msg.endpoint] += sum(t.numel() * t.element_size() for t in tensors)
        if msg.endpoint == "send":
            dst, tag = int(msg.kwargs["dst"]), int(msg.kwargs["tag"])
            for i, t in enumerate(tensors):
                self.sender.send(t.contiguous(), dst, tag + i)
