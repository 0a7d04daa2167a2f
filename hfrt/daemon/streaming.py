"""Running streaming endpoints, an object the DaemonServer owns: a generator endpoint
(`@endpoint(stream=True)`) whose yielded values go to the caller as Partial messages as they are
made, and whose return value is the call's Reply.

Ordering (enforced here): a streaming call starts when it arrives and advances one generator step
per event-loop turn, on the loop thread. Between two steps the loop reads the socket, so a Cancel
closes the generator before its next step (its `finally` runs, it sends nothing more) and other
calls run in between (ordered ones in their arrival order, as always); no step ever runs beside
another call. Each Partial is flushed with the loop turn it was made in. It is given a way to run
a call's task, to read its arguments and to send its outcome; it knows nothing of what an
endpoint streams, nor of sockets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from hfrt.daemon.replies import Replies
from hfrt.protocols import Call

#: runs a coroutine as the task of a call, recorded as running until it is done (RunningCalls.start)
StartTask = Callable[[Call, Coroutine[Any, Any, None]], "asyncio.Task[Any]"]


class StreamRunner:
    """Runs each streaming call as a task, one step per loop turn (see the module docstring).

    start: runs a coroutine as the task of a call (cancelled by a Cancel).
    arguments: the call's arguments, with handles resolved.
    replies: where the partials and the call's result or error go.
    """

    def __init__(self, start: StartTask, arguments: Callable[[Call], tuple[list[Any], dict[str, Any]]],
                 replies: Replies) -> None:
        self._start = start
        self._arguments = arguments
        self._replies = replies

    def start(self, call: Call, fn: Callable[..., Generator[Any, None, Any]], target: Any) -> asyncio.Task[Any]:
        """Run the streaming endpoint `fn` of `target` (the daemon) for `call`, as a task."""
        return self._start(call, self._run(call, fn, target))

    async def _run(self, call: Call, fn: Callable[..., Generator[Any, None, Any]], target: Any) -> None:
        start = time.perf_counter()
        steps: Generator[Any, None, Any] | None = None
        try:
            args, kwargs = self._arguments(call)
            steps = fn(target, *args, **kwargs)
            while True:
                try:
                    part = next(steps)
                except StopIteration as done:
                    value = done.value
                    break
                if call.reply:
                    self._replies.partial(call, part)
                await asyncio.sleep(0)  # one step per loop turn: the Partial leaves, a Cancel or another call gets in
        except Exception as exc:
            self._replies.raised(call, exc)
            return
        finally:
            if steps is not None:
                steps.close()  # a cancelled or failed stream's generator runs its `finally` now
        self._replies.result(call, value, time.perf_counter() - start)
