"""One daemon's tensor plane in one object: store, peers, the data-plane server, and the internal
endpoints the controller calls (`_hfrt_peers`, `_hfrt_free`, `_hfrt_fetch`, `_hfrt_stats`,
`_hfrt_plane_open`, `_hfrt_plane_join`). Created on first use, so a daemon that never touches a
tensor never imports torch. It knows nothing of the role's endpoints.
"""

from __future__ import annotations

import os
from typing import Any

from hfrt.daemon.tensors.plane import DataPlaneServer, as_bytes
from hfrt.log import get_logger


class TensorRuntime:
    def __init__(self, server: DataPlaneServer, key: bytes, options: dict[str, Any]) -> None:
        from hfrt.daemon.tensors import shmfile
        from hfrt.daemon.tensors.peers import Peers
        from hfrt.daemon.tensors.store import TensorStore

        shmfile.remove_stale()
        force = options.get("transfer") or os.environ.get("HFRT_TRANSFER") or None
        self.store = TensorStore(server.owner, stage_in_shm=bool(options.get("stage_in_shm", True)))
        self.peers = Peers(server.owner, self.store, key, force=force)
        self.server = server
        server.store = self.store
        self.inline_max_bytes = int(options.get("inline_max_bytes", 0))
        self._plane_store: Any = None
        self._log = get_logger(part="tensors", daemon=server.owner)

    def export(self, value: Any) -> Any:
        from hfrt.daemon.tensors.convert import export

        return export(value, self.store, self.inline_max_bytes)

    def resolve(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        from hfrt.daemon.tensors.convert import resolve

        return resolve(args, self.peers), resolve(kwargs, self.peers)

    # -- internal endpoints -------------------------------------------------------------------

    def peers_update(self, directory: dict[str, Any]) -> None:
        self.peers.update(directory)

    def free(self, keys: list[str]) -> int:
        return self.store.free(keys)

    def fetch(self, handles: list[Any]) -> list[Any]:
        return [as_bytes(self.store.get(h)) for h in handles]

    def stats(self) -> dict[str, Any]:
        return {
            "store_tensors": len(self.store),
            "store_bytes": self.store.nbytes,
            "pulled": self.peers.stats,
            "served_bytes": dict(self.server.served),
            "forced_backend": self.peers.force,
        }

    def plane_open(self, world: int) -> str:
        from hfrt.daemon.tensors.distplane import open_store

        host = self.server.address[len("tcp://"):].rsplit(":", 1)[0]
        self._plane_store, master = open_store(host, world)
        return master

    def plane_join(self, master: str, world: int, rank: int, backend: str) -> int:
        from hfrt.daemon.tensors.distplane import Group

        group = Group(master, world, rank, backend, store=self._plane_store)
        self.peers.group = group
        self.server.sender = group
        self._log.info("data_plane_joined", backend=backend, rank=rank, world=world)
        return rank

    def close(self) -> None:
        self.peers.close()
        self.store.close()
