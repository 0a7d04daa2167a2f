"""The daemon's side of the tensor plane, an object the DaemonServer owns: its data-plane server
(the socket other daemons pull bytes from), the internal endpoints the controller calls on every
daemon (directory, frees, fetch, stats, data-plane group), and resolving the handles in a call's
arguments. The TensorRuntime (and so torch) is created only when first needed.

It is given the daemon's identity, key and options and its endpoint table (which endpoints take
raw handles); it knows nothing of the role, of replies or of the command socket.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hfrt.daemon.tensors.plane import DataPlaneServer, advertised_host
from hfrt.protocols import Call

if TYPE_CHECKING:
    from hfrt.daemon.tensors.runtime import TensorRuntime
    from hfrt.wire.endpoints import EndpointSpec

#: Calls the controller makes on every daemon for the tensor plane (never in the endpoint table),
#: and the TensorRuntime method each runs.
INTERNAL = {
    "_hfrt_peers": "peers_update",
    "_hfrt_free": "free",
    "_hfrt_fetch": "fetch",
    "_hfrt_stats": "stats",
    "_hfrt_plane_open": "plane_open",
    "_hfrt_plane_join": "plane_join",
}
#: internal calls a daemon that never made a tensor answers without creating the runtime (and torch)
WITHOUT_RUNTIME = frozenset({"_hfrt_peers", "_hfrt_free", "_hfrt_stats"})


class TensorServing:
    """One daemon's tensor plane (see the module docstring).

    identity, key, options: the daemon's (the runtime reads transfer options from `options`).
    table: the daemon's endpoint table; an endpoint declared `raw_handles` gets handles unresolved.
    """

    def __init__(self, identity: str, key: bytes, options: dict[str, Any],
                 table: Mapping[str, tuple[EndpointSpec, Any]]) -> None:
        self._identity = identity
        self._key = key
        self._options = options
        self._table = table
        self._data: DataPlaneServer | None = None
        self._own_data = True  # False: a daemon host's shared server, not this one's to stop
        self._runtime: TensorRuntime | None = None
        self._directory: dict[str, Any] = {}  # the data planes of the daemons this one was told of, so far
        self._handle_calls: set[int] = set()  # call ids whose arguments hold handles

    def start(self, controller: str, shared: DataPlaneServer | None = None) -> None:
        """Open and start the data-plane server, on the interface that reaches `controller`; or,
        in a daemon host, use the host's `shared` one (started, stopped and owned by the host)."""
        if shared is not None:
            self._data, self._own_data = shared, False
            return
        self._data = DataPlaneServer(self._identity, self._key, host=advertised_host(controller))
        self._data.start()

    @property
    def address(self) -> str:
        """Where other daemons pull this one's tensors from ("" before start)."""
        return self._data.address if self._data is not None else ""

    def runtime(self) -> TensorRuntime:
        """This daemon's TensorRuntime (store, peers), created on first use (imports torch)."""
        if self._runtime is None:
            from hfrt.daemon.tensors.runtime import TensorRuntime

            assert self._data is not None, "tensor serving not started"
            if not self._own_data:
                raise RuntimeError(f"{self._identity} runs in a daemon host, which shares one data-plane server "
                                   "and keeps no tensors: its endpoints may only name handles")
            self._runtime = TensorRuntime(self._data, self._key, self._options)
            self._runtime.peers_update(self._directory)
        return self._runtime

    def note_handles(self, call_id: int) -> None:
        """The arguments of call `call_id` hold handles: `arguments` resolves them."""
        self._handle_calls.add(call_id)

    def forget(self, call_id: int) -> None:
        """Call `call_id` ended (or never ran): drop what was recorded for it."""
        self._handle_calls.discard(call_id)

    def remembers(self, call_id: int) -> bool:
        """Whether anything is still recorded for call `call_id`."""
        return call_id in self._handle_calls

    def arguments(self, call: Call) -> tuple[list[Any], dict[str, Any]]:
        """The call's arguments, with any handles resolved into tensors pulled from their owners."""
        if call.call_id not in self._handle_calls:
            return call.args, call.kwargs
        self._handle_calls.discard(call.call_id)
        entry = self._table.get(call.endpoint)
        if entry is not None and entry[0].raw_handles:
            return call.args, call.kwargs
        return self.runtime().resolve(call.args, call.kwargs)

    def internal(self, call: Call) -> Any:
        """Run the internal endpoint `call` names (one of INTERNAL) and return its value; raises
        what it raises. A daemon that never made a tensor answers the directory, frees and stats
        without creating the runtime."""
        self._handle_calls.discard(call.call_id)
        if call.endpoint == "_hfrt_peers":  # entries added or renewed (hfrt.control.tensor_plane.PeerDirectory)
            self._directory.update(call.args[0])  # kept here: a daemon without tensors needs no torch
        if self._runtime is None and call.endpoint in WITHOUT_RUNTIME:
            return {"store_tensors": 0, "store_bytes": 0} if call.endpoint == "_hfrt_stats" else None
        return getattr(self.runtime(), INTERNAL[call.endpoint])(*call.args, **call.kwargs)

    def export(self, value: Any) -> Any:
        """A result value with its tensors stored here and replaced by handles (only a daemon that
        imported torch can return tensors: otherwise `value` as it is)."""
        if "torch" in sys.modules and self._own_data:  # a hosted daemon keeps no tensors
            return self.runtime().export(value)
        return value

    def close(self) -> None:
        """Close the runtime (its store's shared memory) and stop the data-plane server (its own)."""
        if self._runtime is not None:
            self._runtime.close()
        if self._data is not None and self._own_data:
            self._data.stop()
            self._data.join(timeout=2.0)
