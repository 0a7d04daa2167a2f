"""Role-group handles: what flow code awaits on. `actor.generate(x)`, `.call`, `.call_one`, `.broadcast`,
and `.stream` for a streaming endpoint.

A RoleGroup is a view of one role's ranks; an EndpointRef turns a call into per-rank messages by
the endpoint's declared dispatch mode and gathers the per-rank replies into one future. Calling sends at once and
returns a future: start early, await late. A call layer (`CallLayer`, hfrt.control.recovery's
Recovery), when the controller has one, sits between a group and the controller's submit(): the
future it returns may send the call once more. A call whose arguments do not fit the parameters
the daemons declared is refused before anything is sent (hfrt.control.call_check). Knows the
controller's submit() and dispatch rules; knows nothing of sockets or of what the endpoints do.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from hfrt.control.call_check import CallCheck, did_you_mean
from hfrt.control.daemons import DaemonInfo, Registry
from hfrt.control.dispatch import RankSlot, collect, dispatch
from hfrt.protocols.endpoints import EndpointEntry
from hfrt.wire.endpoints import Dispatch
from hfrt.wire.errors import UnknownEndpoint


class Adverb(enum.Enum):
    """How a call reaches a role's ranks (a `broadcast` is never delivered again, so it has none)."""

    #: the endpoint's declared dispatch mode (split, replicate, rank 0): `ref(*args)`
    DISPATCH = "dispatch"
    #: every rank, one reply each, gathered in a list: `ref.call(*args)`
    CALL = "call"
    #: one rank: `ref.call_one(rank, *args)`
    CALL_ONE = "call_one"


@dataclass(frozen=True, slots=True)
class Delivery:
    """How a call was delivered, so a call layer can deliver it again exactly so.

    adverb: how it reached the ranks (Adverb). rank: the rank of a CALL_ONE.
    timeout_s: the call's deadline (None: the controller's default).
    """

    adverb: Adverb
    rank: int = 0
    timeout_s: float | None = None

    def with_deadline(self, deadline: float) -> Delivery:
        """This delivery with its timeout lowered to `deadline` (kept when already lower)."""
        return replace(self, timeout_s=min(deadline, self.timeout_s or deadline))


class CallLayer(Protocol):
    """What sits between role groups and the controller's submit() (hfrt.control.recovery.Recovery).

    The controller is constructed with one and attaches it to its registry; groups send every
    call through `call`; the controller asks `hung` before it times a call out. The rest is what
    flows use: restart hooks, the trainer's rewind after a stateful role was replaced, metrics.
    """

    def attach(self, registry: Registry) -> None: ...

    def call(self, ref: EndpointRef, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]: ...

    def hung(self, info: DaemonInfo) -> bool: ...

    def on_restart(self, role: str, callback: Callable[[list[str]], Any]) -> None: ...

    async def wait_lost_state(self) -> dict[str, str]: ...

    async def settle(self, groups: list[RoleGroup]) -> None: ...

    def rewound(self, lost_s: float) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class Caller(Protocol):
    """What a role group needs of the controller: its submit() — of one call, or of one call to each
    of several ranks as one future (submit_all: the same arguments, encoded once) — and its call layer."""

    recovery: CallLayer | None

    def submit(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
               timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]: ...

    def submit_all(self, infos: list[DaemonInfo], endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                   timeout_s: float | None = None) -> asyncio.Future[Any]: ...

    def submit_each(self, parts: list[tuple[DaemonInfo, list[Any], dict[str, Any]]], endpoint: str, *,
                    timeout_s: float | None = None, combine: Callable[[list[Any]], Any]) -> asyncio.Future[Any]: ...


class RoleGroup:
    """All ranks of one role, in rank order. Endpoints are looked up in the table the daemons sent."""

    def __init__(self, controller: Caller, name: str, daemons: Sequence[DaemonInfo]) -> None:
        self._controller = controller
        self.name = name
        self.daemons = list(daemons)
        self.slots = [RankSlot.of(d.rank, d.dp_rank, d.dp_size, d.meta) for d in self.daemons]
        self._refs: dict[str, EndpointRef] = {}

    def refresh(self, daemons: Sequence[DaemonInfo]) -> None:
        """Point this group at `daemons` (the same ranks, e.g. after hfrt.control.recovery replaced one).
        A new list, never a change in place: whoever kept the old one (a call's makers) keeps a snapshot."""
        self.daemons = list(daemons)
        self.slots = [RankSlot.of(d.rank, d.dp_rank, d.dp_size, d.meta) for d in self.daemons]

    @property
    def world_size(self) -> int:
        return len(self.daemons)

    @property
    def endpoints(self) -> dict[str, dict[str, Any]]:
        return self.daemons[0].endpoints

    def endpoint(self, name: str) -> EndpointRef:
        ref = self._refs.get(name)
        if ref is None:
            spec = self.endpoints.get(name)
            if spec is None:
                known = sorted(self.endpoints)
                suggestion = did_you_mean(name, known)
                head = f"role {self.name!r} has no endpoint {name!r}"
                raise UnknownEndpoint(f"{head} — {suggestion} It has: {', '.join(known)}" if suggestion
                                      else f"{head}; it has: {', '.join(known)}")
            entry = EndpointEntry.from_wire(spec, f"{self.name}.{name}")
            ref = self._refs[name] = EndpointRef(self, name, Dispatch(entry.dispatch), CallCheck.of(f"{self.name}.{name}", entry))
        return ref

    def __getattr__(self, name: str) -> EndpointRef:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.endpoint(name)

    def __repr__(self) -> str:
        return f"RoleGroup({self.name!r}, world_size={self.world_size}, endpoints={sorted(self.endpoints)})"


class EndpointRef:
    """One endpoint of one role group, with its delivery adverbs.

    `ref(*a)` dispatches by the declared mode; `call` sends to every rank and gathers a list;
    `call_one(rank, *a)` sends to one rank; `broadcast` sends to every rank without waiting.
    All take `timeout_s=` as a keyword (untyped callers); `with_timeout(s)` gives the endpoint
    with its own deadline for every call (what typed flows use: hfrt.wire.handles); without
    either, the controller's default applies. Every returned future is already in flight. Each
    adverb first checks the arguments against the parameters the daemons declared (`check`; None
    when they declared none) and raises BadArguments there, before anything is sent.
    """

    def __init__(self, group: RoleGroup, name: str, mode: Dispatch, check: CallCheck | None = None,
                 timeout_s: float | None = None) -> None:
        self.group = group
        self.name = name
        self.mode = mode
        self.check = check
        self.timeout_s = timeout_s  # this endpoint's deadline (None: the controller's default)

    def with_timeout(self, timeout_s: float | None) -> EndpointRef:
        """This endpoint with calls timing out after `timeout_s` seconds (None: the controller's default)."""
        return EndpointRef(self.group, self.name, self.mode, self.check, timeout_s)

    def __call__(self, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> asyncio.Future[Any]:
        if self.check is not None:
            self.check.check(args, kwargs)
        return self._invoke(Delivery(Adverb.DISPATCH, 0, self.timeout_s if timeout_s is None else timeout_s), args, kwargs)

    def call(self, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> asyncio.Future[list[Any]]:
        if self.check is not None:
            self.check.check(args, kwargs)
        return self._invoke(Delivery(Adverb.CALL, 0, self.timeout_s if timeout_s is None else timeout_s), args, kwargs)

    def call_one(self, rank: int, /, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> asyncio.Future[Any]:
        if self.check is not None:
            self.check.check(args, kwargs)
        if all(d.rank != rank for d in self.group.daemons):
            raise IndexError(f"role {self.group.name!r} has no rank {rank} (world_size {self.group.world_size})")
        return self._invoke(Delivery(Adverb.CALL_ONE, rank, self.timeout_s if timeout_s is None else timeout_s), args, kwargs)

    def stream(self, rank: int, /, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Call a streaming endpoint (`@endpoint(stream=True)`) on one rank: a CallStream of the
        values it yields, then its return value (hfrt.control.streams). Never retried by a call layer."""
        if not self.group.endpoints.get(self.name, {}).get("stream"):
            raise TypeError(f"{self.group.name}.{self.name} is not a streaming endpoint (use it as a call)")
        if self.check is not None:
            self.check.check(args, kwargs)
        daemon = next((d for d in self.group.daemons if d.rank == rank), None)
        if daemon is None:
            raise IndexError(f"role {self.group.name!r} has no rank {rank} (world_size {self.group.world_size})")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return self.group._controller.submit_stream(daemon, self.name, list(args), kwargs, timeout_s=timeout_s)  # type: ignore[attr-defined]

    def resend(self, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Deliver a call again exactly as `how` says (hfrt.control.recovery remakes lost handles with it)."""
        return self._invoke(how, args, kwargs)

    def resend_now(self, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Deliver a call as `how` says, without the retry layer (hfrt.control.recovery sets its deadline)."""
        return self._send(how, args, kwargs)

    def _invoke(self, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Send now; with recovery on, the returned future is a task that may send once more (hfrt.control.recovery)."""
        recovery = self.group._controller.recovery
        if recovery is None:
            return self._send(how, args, kwargs)
        return recovery.call(self, how, args, kwargs)

    def _send(self, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        adverb, rank, timeout_s = how.adverb, how.rank, how.timeout_s
        group = self.group
        caller = group._controller
        if adverb is Adverb.CALL or (adverb is Adverb.DISPATCH and self.mode is Dispatch.REPLICATE):
            return caller.submit_all(group.daemons, self.name, list(args), kwargs, timeout_s=timeout_s)  # encoded once
        if adverb is Adverb.CALL_ONE:
            return self._submit(next(d for d in group.daemons if d.rank == rank), list(args), kwargs, timeout_s)
        if self.mode is Dispatch.RANK0:
            return self._submit(group.daemons[0], list(args), kwargs, timeout_s)
        try:
            plan = dispatch(self.mode, self.name, group.slots, args, kwargs)
        except ValueError as exc:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.set_exception(ValueError(f"{group.name}.{exc}"))
            return future
        by_rank = {d.rank: d for d in group.daemons}
        slots = [slot for slot, _, _ in plan]
        mode = self.mode
        return caller.submit_each([(by_rank[slot.rank], a, kw) for slot, a, kw in plan], self.name, timeout_s=timeout_s,
                                  combine=lambda results: collect(mode, slots, results))

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every rank and return at once; failures are logged by the controller."""
        if self.check is not None:
            self.check.check(args, kwargs)
        for d in self.group.daemons:
            self.group._controller.submit(d, self.name, list(args), kwargs, reply=False)

    def _submit(self, daemon: DaemonInfo, args: list[Any], kwargs: dict[str, Any], timeout_s: float | None) -> asyncio.Future[Any]:
        return self.group._controller.submit(daemon, self.name, args, kwargs, timeout_s=timeout_s)
