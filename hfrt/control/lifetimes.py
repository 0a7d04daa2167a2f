"""Freeing daemon-side tensors when the flow drops the last handle that names them.

Every handle the controller decodes from a reply is tracked: each stored key has a reference
count (the same key can come back in several replies), and a weakref finalizer on each decoded
handle gives its references back. Keys whose count reaches zero are queued per owner and sent in
one batched free message per owner on the next loop turn. Pending calls hold their arguments, so
a handle in flight is never freed under a daemon that is about to pull it. It knows handles and
a send function; it knows nothing of sockets.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

from hfrt.protocols import BatchHandle, TensorHandle

FreeFn = Callable[[str, list[str]], None]


class HandleTracker:
    def __init__(self, loop: asyncio.AbstractEventLoop, free: FreeFn) -> None:
        self._loop = loop
        self._free = free
        self._refs: Counter[tuple[str, str]] = Counter()
        self._queued: dict[str, list[str]] = {}
        self._scheduled = False

    @property
    def live_keys(self) -> int:
        return len(self._refs)

    def track(self, value: Any) -> None:
        """Register every handle inside a freshly decoded reply value."""
        if isinstance(value, BatchHandle):
            self._hold(value, [(o, k) for o, keys in value.keys_by_owner().items() for k in keys])
        elif isinstance(value, TensorHandle):
            self._hold(value, [(value.owner, value.key)])
        elif isinstance(value, dict):
            for v in value.values():
                self.track(v)
        elif isinstance(value, list):
            for v in value:
                self.track(v)

    def _hold(self, handle: Any, keys: list[tuple[str, str]]) -> None:
        self._refs.update(keys)
        weakref.finalize(handle, self._release, keys)

    def _release(self, keys: list[tuple[str, str]]) -> None:
        # May run inside garbage collection at any point of the loop's thread: only queue here.
        for owner_key in keys:
            self._refs[owner_key] -= 1
            if self._refs[owner_key] <= 0:
                del self._refs[owner_key]
                self._queued.setdefault(owner_key[0], []).append(owner_key[1])
        if self._queued and not self._scheduled and not self._loop.is_closed():
            self._scheduled = True
            self._loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        queued, self._queued = self._queued, {}
        for owner, keys in queued.items():
            self._free(owner, keys)
