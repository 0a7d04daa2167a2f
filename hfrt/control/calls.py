"""The controller's calls in flight, an object the Controller owns: call id → Pending; sending one
call, or a group call (one call to each of several ranks, sent at once, with one future for all
of them and the arguments encoded once when every rank gets the same); deadlines, cancellation;
and settling each call with its reply, its error, or a failure the controller declares.

A call that names handles is preceded, on the same ordered channel, by the directory entries its
daemon lacks (`introduce`, the tensor plane's). It is given the wire, a way to send frames to a
daemon, the tensor plane's `introduce` and `track`, why a daemon cannot be called now (`refusal`),
what an overdue call means (`overdue`: True when the controller treats it as a hang), a way to
tell a daemon to cancel a call, the stray-reply records, the counters (`byte_counts`: endpoints
whose bytes are counted, e.g. the directory's) and a log. It knows nothing of sockets, roles or
recovery.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from hfrt.control.daemons import DaemonInfo
from hfrt.control.pending import Gather, Pending, fail_all
from hfrt.control.strays import StrayReplies
from hfrt.control.trace import CallTrace
from hfrt.protocols import Call, Error, Reply, Wire, WireError
from hfrt.wire.errors import CallTimeout, RemoteError

#: what a group call's per-rank values become (list: one per rank, in the order sent)
Combine = Callable[[list[Any]], Any]
#: errors packing a call's arguments can raise (named with the call, on its future)
PACK_ERRORS = (WireError, TypeError, ValueError, OverflowError)


class CallTable:
    """The calls in flight (see the module docstring); `trace`, when set, gets a span per call."""

    def __init__(self, wire: Wire, send_frames: Callable[[DaemonInfo, list[Any]], None], *,
                 introduce: Callable[[DaemonInfo, list[Any]], None], track: Callable[[Any], None],
                 refusal: Callable[[DaemonInfo, str], BaseException | None],
                 overdue: Callable[[int, Pending, float], bool], cancel: Callable[[DaemonInfo, int], None],
                 strays: StrayReplies, stats: dict[str, int], log: Any, default_timeout_s: float | None,
                 byte_counts: dict[str, str] | None = None) -> None:
        self.calls: dict[int, Pending] = {}
        self.next_id = 1
        self.trace: CallTrace | None = None
        self.default_timeout_s = default_timeout_s
        self._wire, self._send_frames = wire, send_frames
        self._introduce, self._track, self._refusal = introduce, track, refusal
        self._overdue, self._cancel = overdue, cancel
        self._strays, self._stats, self._log = strays, stats, log
        self._byte_counts = byte_counts or {}  # endpoint → the counter its single calls' bytes add to
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # -- sending --------------------------------------------------------------------------------

    def send(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
             timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]:
        """One Call to one daemon, now; the future resolves with its Reply value."""
        assert self._loop is not None, "controller not started"
        future: asyncio.Future[Any] = self._loop.create_future()
        refused = self._refusal(info, endpoint)
        if refused is not None:
            future.set_exception(refused)
            return future
        call_id = self.next_id
        self.next_id = call_id + 1
        try:
            frames = self._wire.pack(Call(call_id, endpoint, args, kwargs, reply))
        except PACK_ERRORS as exc:
            future.set_exception(type(exc)(f"{info.role}[{info.rank}].{endpoint}: cannot send arguments: {exc}"))
            return future
        records = self._wire.codec.records_packed
        counted = self._byte_counts.get(endpoint)
        if counted is not None:
            self._stats[counted] += len(frames[0])
        if reply:
            self._pend(call_id, Pending(future, info, endpoint, time.perf_counter()), timeout_s)
            future.add_done_callback(functools.partial(self._on_future_done, call_id))
        else:
            future.set_result(None)
            if self.trace is not None:
                self.trace.add(info.identity, endpoint, call_id, time.perf_counter(), "sent")
        self._out(info, frames, records)
        return future

    def send_all(self, infos: Sequence[DaemonInfo], endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                 timeout_s: float | None = None, combine: Combine = list) -> asyncio.Future[Any]:
        """The same Call to every daemon of `infos`, now, its arguments encoded once; one future:
        combine(the values in the order of `infos`), or the first failure."""
        gather, live = self._gather(infos, endpoint, combine)
        if not live:
            return gather.future
        ids = range(self.next_id, self.next_id + len(live))
        self.next_id += len(live)
        try:
            packed = self._wire.pack_calls(ids, endpoint, args, kwargs)
        except PACK_ERRORS as exc:
            info = live[0][1]
            gather.fail(type(exc)(f"{info.role}[{info.rank}].{endpoint}: cannot send arguments: {exc}"))
            return gather.future
        records = self._wire.codec.records_packed
        sent = time.perf_counter()
        for (index, info), call_id, frames in zip(live, ids, packed, strict=True):
            self._pend(call_id, Pending(None, info, endpoint, sent, gather, index), timeout_s)
            gather.call_ids.append(call_id)
            self._out(info, frames, records)
        return gather.future

    def send_each(self, parts: Sequence[tuple[DaemonInfo, list[Any], dict[str, Any]]], endpoint: str, *,
                  timeout_s: float | None = None, combine: Combine = list) -> asyncio.Future[Any]:
        """One Call per (daemon, args, kwargs) of `parts`, now; one future: combine(the values in
        the order of `parts`), or the first failure."""
        gather, live = self._gather([info for info, _, _ in parts], endpoint, combine)
        for index, info in live:
            _, args, kwargs = parts[index]
            call_id = self.next_id
            self.next_id = call_id + 1
            try:
                [frames] = self._wire.pack_calls((call_id,), endpoint, args, kwargs)
            except PACK_ERRORS as exc:
                gather.fail(type(exc)(f"{info.role}[{info.rank}].{endpoint}: cannot send arguments: {exc}"))
                continue
            self._pend(call_id, Pending(None, info, endpoint, time.perf_counter(), gather, index), timeout_s)
            gather.call_ids.append(call_id)
            self._out(info, frames, self._wire.codec.records_packed)
        return gather.future

    def _gather(self, infos: Sequence[DaemonInfo], endpoint: str, combine: Combine) -> tuple[Gather, list[tuple[int, DaemonInfo]]]:
        """A Gather over `infos`, failed at once if a daemon cannot be called; the (index, daemon) to send to."""
        assert self._loop is not None, "controller not started"
        gather = Gather(self._loop.create_future(), len(infos), combine)
        gather.future.add_done_callback(functools.partial(self._on_gather_done, gather))
        live = []
        for index, info in enumerate(infos):
            refused = self._refusal(info, endpoint)
            if refused is not None:
                gather.fail(refused)
            else:
                live.append((index, info))
        if not infos:
            gather.future.set_result(combine([]))
        return gather, live

    def _pend(self, call_id: int, pending: Pending, timeout_s: float | None) -> Pending:
        assert self._loop is not None
        self.calls[call_id] = pending
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if timeout is not None:
            pending.timer = self._loop.call_later(timeout, self._expire, call_id, timeout)
        return pending

    def _out(self, info: DaemonInfo, frames: list[Any], records: list[Any]) -> None:
        if records:  # it names handles: their owners' directory entries go first
            self._introduce(info, records)
        self._stats["calls_sent"] += 1
        self._send_frames(info, frames)

    # -- deadlines and cancellation ---------------------------------------------------------------

    def restart_deadline(self, call_id: int, pending: Pending, timeout: float) -> None:
        """A pending call with a deadline gets `timeout` seconds from now (a stream's partial arrived)."""
        if pending.timer is not None and self._loop is not None:
            pending.timer.cancel()
            pending.timer = self._loop.call_later(timeout, self._expire, call_id, timeout)

    def _expire(self, call_id: int, timeout: float) -> None:
        pending = self.calls.pop(call_id, None)
        if pending is None:
            return
        if self._overdue(call_id, pending, timeout):  # treated as a hang: the controller declared its daemon gone
            return
        info = pending.daemon
        self.span(call_id, pending, "timeout")
        self._cancel(info, call_id)
        pending.fail(CallTimeout(f"{info.role}[{info.rank}].{pending.endpoint} did not finish within {timeout}s; cancelled"))

    def _on_future_done(self, call_id: int, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._cancel_pending(call_id)

    def _on_gather_done(self, gather: Gather, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            for call_id in gather.call_ids:
                self._cancel_pending(call_id)

    def _cancel_pending(self, call_id: int) -> None:
        pending = self.calls.pop(call_id, None)
        if pending is not None:
            self.span(call_id, pending, "cancelled")
            if pending.timer is not None:
                pending.timer.cancel()
            self._cancel(pending.daemon, call_id)

    # -- outcomes -----------------------------------------------------------------------------------

    def span(self, call_id: int, pending: Pending, status: str) -> None:
        """Record how a call ended: given up on (gone, timeout, cancelled: its reply may still come), traced."""
        if status != "error":
            self._strays.given_up(call_id)
        if self.trace is not None:
            self.trace.add(pending.daemon.identity, pending.endpoint, call_id, pending.sent, status)

    def fail_all(self, error: Callable[[Pending], BaseException], of: DaemonInfo | None = None) -> None:
        """Fail every pending call (`of`: only those sent to that daemon) with error(call)."""
        fail_all(self.calls, error, self.span, of=of)

    def take(self, ident: bytes, call_id: int, kind: str) -> Pending | None:
        """The pending call `call_id`, taken out, if `ident` is the daemon it was sent to; a reply or
        error for it from any other peer (even one holding the key) is dropped, logged and counted."""
        pending = self.calls.get(call_id)
        if pending is None:
            self._strays.arrived(ident, call_id, kind)  # given up on (counted), or never ours (also logged)
            return None
        if ident != pending.daemon.route:
            self._stats["dropped_replies"] += 1
            self._log.warning("dropped_reply", peer=ident.decode("utf-8", "replace"), kind=kind, call_id=call_id,
                              sent_to=pending.daemon.identity)
            return None
        del self.calls[call_id]
        return pending

    def reply(self, ident: bytes, msg: Reply, now: float) -> bool:
        """A Reply from the daemon with routing id `ident`, read at `now` (loop clock); False when
        no pending call of that daemon was waiting for it (a stray: late, or not ours)."""
        pending = self.take(ident, msg.call_id, "reply")
        if pending is None:
            return False
        if self.trace is not None:
            self.trace.add(pending.daemon.identity, pending.endpoint, msg.call_id, pending.sent, "ok")
        pending.daemon.last_seen = now
        if pending.timer is not None:
            pending.timer.cancel()
        self._stats["replies"] += 1
        if self._wire.codec.records_seen:
            self._track(msg.value)
        pending.resolve(msg.value)
        return True

    def error(self, ident: bytes, msg: Error, now: float | None = None) -> bool:
        """An Error from the daemon with routing id `ident`, read at `now` (loop clock; a sign of
        life as a Reply is): the call it names fails with RemoteError. False when no pending call
        of that daemon was waiting for it."""
        self._stats["errors"] += 1
        pending = self.take(ident, msg.call_id, "error") if msg.call_id else None
        if pending is None:
            if msg.call_id not in self.calls:  # a forged one was logged as dropped_reply
                self._log.warning("daemon_error", peer=ident.decode("utf-8", "replace"), type=msg.type, message=msg.message)
            return False
        if now is not None:
            pending.daemon.last_seen = now
        self.span(msg.call_id, pending, "error")
        if pending.timer is not None:
            pending.timer.cancel()
        pending.fail(RemoteError(pending.where, msg.type, msg.message, msg.traceback, msg.param))
        return True
