"""Running streaming endpoints, mixed into DaemonServer: a generator endpoint (`@endpoint(stream=True)`)
whose yielded values go to the caller as Partial messages as they are made, and whose return value
is the call's Reply.

Ordering (enforced here): a streaming call starts when it arrives and advances one generator step
per event-loop turn, on the loop thread. Between two steps the loop reads the socket, so a Cancel
closes the generator before its next step (its `finally` runs, it sends nothing more) and other
calls run in between (ordered ones in their arrival order, as always); no step ever runs beside
another call. Each Partial is flushed with the loop turn it was made in. It knows the server's
call records and sending; nothing of what an endpoint streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from hfrt.protocols import Call, Partial, WireError

if TYPE_CHECKING:
    from hfrt.protocols import Message


class StreamServing:
    """Needs from its host class: daemon, _track, _arguments, _finish, _finish_error, _send."""

    daemon: Any

    if TYPE_CHECKING:
        def _track(self, call: Call, coro: Any) -> asyncio.Task[Any]: ...
        def _arguments(self, call: Call) -> tuple[list[Any], dict[str, Any]]: ...
        def _finish(self, call: Call, value: Any, elapsed: float) -> None: ...
        def _finish_error(self, call: Call, exc: BaseException) -> None: ...
        def _send(self, msg: Message) -> None: ...

    def _start_stream(self, call: Call, fn: Any) -> None:
        """Run the streaming endpoint `fn` for `call` as a task (cancelled by a Cancel; the host
        records it as running until the task is done)."""
        self._track(call, self._run_stream(call, fn))

    async def _run_stream(self, call: Call, fn: Any) -> None:
        start = time.perf_counter()
        steps: Generator[Any, None, Any] | None = None
        try:
            args, kwargs = self._arguments(call)
            steps = fn(self.daemon, *args, **kwargs)
            while True:
                try:
                    part = next(steps)
                except StopIteration as done:
                    value = done.value
                    break
                if call.reply:
                    self._send_partial(call, part)
                await asyncio.sleep(0)  # one step per loop turn: the Partial leaves, a Cancel or another call gets in
        except Exception as exc:
            self._finish_error(call, exc)
            return
        finally:
            if steps is not None:
                steps.close()  # a cancelled or failed stream's generator runs its `finally` now
        self._finish(call, value, time.perf_counter() - start)

    def _send_partial(self, call: Call, part: Any) -> None:
        """Partials are plain msgpack values (tokens, text): a tensor there fails the call."""
        try:
            self._send(Partial(call.call_id, part))
        except (WireError, TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"{call.endpoint} yielded a value hfrt cannot send: {exc}") from exc
