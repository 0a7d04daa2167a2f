"""What a call's outcome sends back to the controller, owned by the DaemonServer: its Reply (result
tensors stored here and sent as handles), its Error (type, message, remote traceback, and the name
of the refused argument when the endpoint raised InvalidArgument), or a streaming call's Partial.
A reply that a Cancel asked to drop (a threaded call cancelled while in its thread) is not sent;
an error always is.

It is given the wire (packing, signing), a function that sends frames, the running-call records,
a way to export result tensors and the Traffic record it stamps with each outcome sent (the
heartbeat skips beats those outcomes make redundant); it knows nothing of endpoints, ordering or
the socket.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from hfrt.daemon.heartbeat import Traffic
from hfrt.daemon.running import RunningCalls
from hfrt.protocols import Call, Error, Message, Partial, Reply, Wire, WireError
from hfrt.wire.errors import InvalidArgument


class Replies:
    """Sends each call's outcome (see the module docstring).

    wire: packs and signs messages. send_frames: sends packed frames to the controller.
    running: the running-call records (a finished call leaves them; a dropped reply is skipped).
    export: a result value with its tensors stored and replaced by handles.
    log: where a raising endpoint is logged. traffic: stamped `sent` with each outcome sent.
    """

    def __init__(self, wire: Wire, send_frames: Callable[[list[Any]], None], running: RunningCalls,
                 export: Callable[[Any], Any], log: Any, traffic: Traffic | None = None) -> None:
        self.traffic = traffic or Traffic()
        self._wire = wire
        self._send_frames = send_frames
        self._running = running
        self._export = export
        self._log = log

    def send(self, msg: Message) -> None:
        """Pack and send one message now."""
        self._send_frames(self._wire.pack(msg))

    def result(self, call: Call, value: Any, elapsed: float) -> None:
        """The endpoint returned `value` after `elapsed` seconds: reply, unless the caller wants
        none or a Cancel asked to drop it. A value that cannot be stored or sent fails the call."""
        if not self._running.finished(call.call_id) or not call.reply:
            return
        try:
            frames = self._wire.pack(Reply(call.call_id, self._export(value), elapsed))
        except WireError as exc:
            self.error(call, "ResultTooLarge", str(exc))
            return
        except (TypeError, ValueError, OverflowError) as exc:
            self.error(call, "UnencodableResult", f"{call.endpoint} returned a value hfrt cannot send: {exc}")
            return
        except Exception as exc:  # storing a result tensor failed (e.g. /dev/shm full)
            self.error(call, "ResultNotStored", f"{call.endpoint}: {type(exc).__name__}: {exc}")
            return
        self._send_frames(frames)
        self.traffic.sent = time.monotonic()

    def raised(self, call: Call, exc: BaseException) -> None:
        """The endpoint raised `exc` (being handled): an Error with its traceback, even for a
        threaded call a Cancel asked to drop."""
        self._running.finished(call.call_id)
        self._log.warning("endpoint_raised", call_id=call.call_id, endpoint=call.endpoint, error=type(exc).__name__)
        param = exc.param if isinstance(exc, InvalidArgument) else None
        self.error(call, type(exc).__name__, str(exc), traceback.format_exc(), param)

    def error(self, call: Call, type_name: str, message: str, tb: str = "", param: str | None = None) -> None:
        """Answer `call` with an Error (`param`: the argument or option the endpoint refused)."""
        self.send(Error(call.call_id, type_name, message, tb, param))
        self.traffic.sent = time.monotonic()

    def partial(self, call: Call, part: Any) -> None:
        """One value a streaming endpoint yielded. Partials are plain msgpack values (tokens,
        text): one that cannot be sent (a tensor) raises TypeError naming the endpoint."""
        try:
            self.send(Partial(call.call_id, part))
        except (WireError, TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"{call.endpoint} yielded a value hfrt cannot send: {exc}") from exc
        self.traffic.sent = time.monotonic()
