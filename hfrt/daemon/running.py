"""The calls a daemon is running: each call's task from its start until it is done, however it
ends; which of them are inside a thread (those cannot be interrupted: a Cancel only drops their
reply); and waiting for them all when the daemon shuts down.

The records are dropped in the task's done-callback, so a call cancelled before its first step
(whose body never runs) leaves nothing behind. It knows asyncio tasks and call ids; it knows
nothing of sockets, endpoints or roles.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from hfrt.protocols import Call

#: how long a shutdown waits for the calls it cancelled after the grace period to end
CANCEL_WAIT_S = 0.5


class RunningCalls:
    """call id → task of every running call. `forget(call_id)` drops the server's own records of
    a call (such as its handle arguments) when its task is done."""

    def __init__(self, log: Any, forget: Callable[[int], None]) -> None:
        self.tasks: dict[int, asyncio.Task[Any]] = {}
        self.skip_reply: set[int] = set()  # cancelled while in a thread: its reply is dropped
        self._threaded: set[int] = set()
        self._log = log
        self._forget = forget

    def start(self, loop: asyncio.AbstractEventLoop, call: Call, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as the task of `call`, recorded until the task is done."""
        task = loop.create_task(coro, name=f"{call.endpoint}#{call.call_id}")
        self.tasks[call.call_id] = task
        task.add_done_callback(functools.partial(self._done, call.call_id))
        return task

    def in_thread(self, call_id: int) -> None:
        """The call is handing its endpoint to a thread: from now on it cannot be interrupted."""
        self._threaded.add(call_id)

    def cancel(self, call_id: int) -> bool:
        """Cancel a running call (a threaded one: drop its reply); False when none runs."""
        task = self.tasks.get(call_id)
        if task is None:
            return False
        if call_id in self._threaded:
            self.skip_reply.add(call_id)
        else:
            task.cancel()
        return True

    def finished(self, call_id: int) -> bool:
        """The call's endpoint returned; False when a Cancel asked for its reply to be dropped."""
        self.tasks.pop(call_id, None)
        if call_id in self.skip_reply:
            self.skip_reply.discard(call_id)
            return False
        return True

    def _done(self, call_id: int, task: asyncio.Task[Any]) -> None:
        if self.tasks.get(call_id, task) is not task:
            return  # a later call reused the id: the records are its own now
        self.tasks.pop(call_id, None)
        self._threaded.discard(call_id)
        self.skip_reply.discard(call_id)
        self._forget(call_id)
        if task.cancelled():
            self._log.debug("call_cancelled", call_id=call_id, call=task.get_name())

    async def settle(self, grace_s: float) -> list[str]:
        """Wait up to grace_s for every running call (threaded ones included), then cancel the
        rest and wait CANCEL_WAIT_S for them. Returns the calls given up on ("endpoint#call_id"):
        threaded ones still in their thread (it runs on) and any that ignored the cancel."""
        running = {task: call_id for call_id, task in self.tasks.items()}
        if not running:
            return []
        _, pending = await asyncio.wait(running, timeout=grace_s)
        in_thread = {t.get_name() for t in pending if running[t] in self._threaded}
        for task in pending:
            task.cancel()
        if pending:
            _, pending = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
        return sorted(in_thread | {t.get_name() for t in pending})
