"""Who owns the controller's background tasks, and what a failure of its own machinery does: it
fails the session, loudly, once.

An owned task (the liveness watcher) that ends other than by close() is such a failure, and so is
a gone-listener that raises. The failure is logged as an error and handed to the controller, which
fails every pending call with it; every later call, role lookup and close() raises it again. It is
never swallowed: a controller that can no longer tell when a daemon dies would leave calls hanging.
It knows asyncio tasks and a logger; it knows nothing of sockets, daemons or calls.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable
from typing import Any

from hfrt.wire.errors import ControllerFailed


class Supervisor:
    """Owns the controller's background tasks; `on_failure` is told of the first failure."""

    def __init__(self, log: Any, on_failure: Callable[[ControllerFailed], None]) -> None:
        self.failure: ControllerFailed | None = None
        self._log = log
        self._on_failure = on_failure
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._closing = False

    def own(self, task: asyncio.Task[Any], what: str) -> asyncio.Task[Any]:
        """`task` (named `what` in errors) must run until close(): its end before that fails the session."""
        self._tasks[task] = what
        task.add_done_callback(self._ended)
        return task

    def guarded(self, what: str, fn: Callable[..., object], *args: Any) -> None:
        """fn(*args); an exception it raises fails the session instead of escaping to the caller."""
        try:
            fn(*args)
        except Exception as exc:
            self.fail(f"{what} {getattr(fn, '__qualname__', repr(fn))}", exc)

    def fail(self, what: str, exc: BaseException) -> None:
        """Fail the session: `what` (a part of the controller) raised `exc`. Only the first counts."""
        if self.failure is not None:
            self._log.error("controller_failed_again", part=what, error=f"{type(exc).__name__}: {exc}")
            return
        failure = ControllerFailed(f"the controller's {what} failed: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
        self.failure = failure
        self._log.error("controller_failed", part=what, error=f"{type(exc).__name__}: {exc}",
                        traceback="".join(traceback.format_exception(exc)))
        self._on_failure(failure)

    def error(self, where: str) -> ControllerFailed:
        """A fresh error for one caller (`where`: what could not go on) that names the failure."""
        assert self.failure is not None
        error = ControllerFailed(f"{where}: {self.failure}" if where else str(self.failure))
        error.__cause__ = self.failure.__cause__
        return error

    def check(self, where: str) -> None:
        """Raise the failure (named for `where`) if the session has failed."""
        if self.failure is not None:
            raise self.error(where)

    async def close(self) -> None:
        """Cancel the owned tasks and wait for them (their end is no failure now)."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        what = self._tasks.pop(task, "background task")
        if self._closing:
            return
        if task.cancelled():
            self.fail(what, asyncio.CancelledError(f"{what} was cancelled while the controller was open"))
        elif (exc := task.exception()) is not None:
            self.fail(what, exc)
        else:
            self.fail(what, RuntimeError(f"{what} returned while the controller was open"))
