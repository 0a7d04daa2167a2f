"""The daemon server's side of the tensor plane, mixed into DaemonServer: the internal endpoints
the controller calls (directory, frees, fetch, stats, data-plane group) and resolving handles in
call arguments. The TensorRuntime (and so torch) is created only when first needed.

It knows the server's call records and the tensor runtime; it knows nothing of the role.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hfrt.protocols import Call

if TYPE_CHECKING:
    from hfrt.daemon.tensors.plane import DataPlaneServer
    from hfrt.wire.endpoints import EndpointSpec

#: Calls the controller makes on every daemon for the tensor plane (never in the endpoint table).
INTERNAL = {
    "_hfrt_peers": "peers_update",
    "_hfrt_free": "free",
    "_hfrt_fetch": "fetch",
    "_hfrt_stats": "stats",
    "_hfrt_plane_open": "plane_open",
    "_hfrt_plane_join": "plane_join",
}



class TensorPlaneServing:
    """Needs from its host class: _data, _key, context, _table, _handle_calls, _tensors,
    _directory, _finish, _finish_error."""

    _data: DataPlaneServer | None
    _key: bytes
    _table: dict[str, tuple[EndpointSpec, Any]]
    _handle_calls: set[int]
    _tensors: Any
    _directory: dict[str, Any]
    context: Any

    if TYPE_CHECKING:
        def _finish(self, call: Call, value: Any, elapsed: float) -> None: ...
        def _finish_error(self, call: Call, exc: BaseException) -> None: ...

    def tensors(self) -> Any:
        """This daemon's TensorRuntime (store, peers), created on first use."""
        if self._tensors is None:
            from hfrt.daemon.tensors.runtime import TensorRuntime

            assert self._data is not None
            self._tensors = TensorRuntime(self._data, self._key, self.context.options)
            self._tensors.peers_update(self._directory)
        return self._tensors

    def _arguments(self, call: Call) -> tuple[list[Any], dict[str, Any]]:
        """The call's arguments, with any handles resolved into tensors pulled from their owners."""
        if call.call_id not in self._handle_calls:
            return call.args, call.kwargs
        self._handle_calls.discard(call.call_id)
        entry = self._table.get(call.endpoint)
        if entry is not None and entry[0].raw_handles:
            return call.args, call.kwargs
        return self.tensors().resolve(call.args, call.kwargs)  # type: ignore[no-any-return]

    def _run_internal(self, call: Call) -> None:
        self._handle_calls.discard(call.call_id)
        start = time.perf_counter()
        try:
            if call.endpoint == "_hfrt_peers":
                self._directory = call.args[0]  # kept here: a daemon without tensors needs no torch
            if self._tensors is None and call.endpoint in ("_hfrt_peers", "_hfrt_free", "_hfrt_stats"):
                value: Any = {"store_tensors": 0, "store_bytes": 0} if call.endpoint == "_hfrt_stats" else None
            else:
                value = getattr(self.tensors(), INTERNAL[call.endpoint])(*call.args, **call.kwargs)
        except Exception as exc:
            self._finish_error(call, exc)
        else:
            self._finish(call, value, time.perf_counter() - start)
