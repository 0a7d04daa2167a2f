"""The base class of role daemons: what a role author subclasses and decorates with @endpoint.

A Daemon holds role state (models, optimizers) and its endpoints. It knows its place in the
role group (DaemonContext) but nothing of sockets, ordering or heartbeats: hfrt.daemon.server runs it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hfrt.wire.endpoints import endpoint


@dataclass(frozen=True, slots=True)
class DaemonContext:
    """Where a daemon sits: role name, rank in the group, data-parallel coordinate, options.

    options: implementation-specific settings (model path, engine choice, ...), from the launcher.
    """

    role: str
    rank: int = 0
    world_size: int = 1
    dp_rank: int = -1
    dp_size: int = -1
    impl: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.dp_size == -1:
            object.__setattr__(self, "dp_size", self.world_size)
        if self.dp_rank == -1:
            object.__setattr__(self, "dp_rank", self.rank * self.dp_size // self.world_size)
        if self.world_size % self.dp_size or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(
                f"dp_rank {self.dp_rank} / dp_size {self.dp_size} do not fit world_size {self.world_size}"
            )

    @property
    def identity(self) -> str:
        return f"{self.role}:{self.rank}"


class Daemon:
    """Subclass, add `@endpoint` methods, and optionally override setup/teardown.

    Every daemon also answers `describe`, which reports where it runs.
    """

    def __init__(self, context: DaemonContext) -> None:
        self.context = context
        self._plane: Callable[[], Any] | None = None  # returns the TensorRuntime (use_tensor_plane)

    def use_tensor_plane(self, runtime: Callable[[], Any]) -> None:
        """The server that runs this daemon gives it its tensor runtime: `runtime()` returns it,
        created on first use (hfrt.daemon.tensor_serving)."""
        self._plane = runtime

    def tensor_plane(self) -> Any:
        """This daemon's tensor runtime (`.store`, `.peers.pull(handles)`), for raw_handles endpoints."""
        if self._plane is None:
            raise RuntimeError("this daemon is not being served (no tensor plane)")
        return self._plane()

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        """Raise ValueError naming what is wrong with `context.options`, loading nothing.
        `hfrt controller` runs it for the roles a user configured before any daemon starts
        (hfrt.roles.check); setup should call it too, so both read options the same way."""

    async def setup(self) -> None:
        """Load models and build engines; runs before the daemon says hello."""

    async def teardown(self) -> None:
        """Release resources; runs once when the daemon stops, whatever the reason."""

    def dp_axes(self) -> dict[str, list[int]]:
        """Data-parallel coordinates this daemon declares in its hello, read after setup: name →
        [rank, size]. "dp" replaces the context's dp coordinate; "generation" is what
        Dispatch.SPLIT_GENERATION splits by (hfrt.control.dispatch). None declared by default."""
        return {}

    @endpoint
    def describe(self) -> dict[str, Any]:
        ctx = self.context
        return {
            "role": ctx.role,
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "dp_rank": ctx.dp_rank,
            "dp_size": ctx.dp_size,
            "impl": ctx.impl,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
