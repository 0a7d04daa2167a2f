"""Typed role handles, as a flow sees them: `Endpoint[P, R]` (one endpoint's call and its adverbs),
`RoleHandle` (what every role handle has) and `@remote`, which declares a role's endpoints on a
view class (the built-in roles' views are hfrt.wire.role_views).

`typed(await ctl.role("actor"), Actor)` (hfrt.control.typed_roles) returns the role group typed
as the view `Actor`, so a type checker reads `actor.generate` as `Endpoint[P, R]`:
a misspelled endpoint, keyword or argument type in a flow is a type error. The signatures are the
controller side's, not the daemon's: a daemon method takes and returns `Batch`es and one rank's
result, while a flow passes `BatchHandle`s (or lists) and awaits a future of what the endpoint's
dispatch mode collects over the ranks — a `BatchHandle` for a batch split by data-parallel rank,
a list of per-rank values for a replicated endpoint, rank 0's value for a rank-0 endpoint. A view
is a Protocol, a type and nothing more: its bodies never run, it cannot be instantiated, and the
object a flow holds is the role group itself (hfrt.control.group), which still checks every call
against the table the daemons sent in hello before anything is sent (so an untyped flow gets the
same refusal, at run time). A test
holds each built-in view to its daemon class (names, kinds, defaults, types with Batch read as
BatchHandle, results as the dispatch mode collects them).

No torch, no sockets: it knows typing and the BatchHandle record, nothing of dispatch or daemons.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

P = ParamSpec("P")
R = TypeVar("R")

#: the marker `@remote` sets on a declared endpoint
_MARK = "__hfrt_remote__"


class Stream(Protocol):
    """A call of a streaming endpoint: the values it yields (`async for`), then `await result()`."""

    def __aiter__(self) -> Stream: ...

    async def __anext__(self) -> Any: ...

    async def result(self) -> Any: ...

    async def aclose(self) -> None: ...


class Endpoint(Protocol[P, R]):
    """One endpoint of a role group, typed: its parameters P (controller side) and R, what a call
    dispatched by the endpoint's declared mode gives. Every adverb sends at once.

    `ep(*a)`: the declared dispatch → a future of R. `ep.call(*a)`: every rank → a future of the
    per-rank results. `ep.call_one(rank, *a)`: one rank → its result. `ep.broadcast(*a)`: every
    rank, nothing awaited. `ep.stream(rank, *a)`: a streaming endpoint's values, then its result.
    `ep.with_timeout(s)`: the same endpoint whose calls time out after s seconds instead of the
    controller's default (None: no deadline of its own).
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[R]: ...

    def call(self, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[list[Any]]: ...

    def call_one(self, rank: int, /, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[Any]: ...

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None: ...

    def stream(self, rank: int, /, *args: P.args, **kwargs: P.kwargs) -> Stream: ...

    def with_timeout(self, timeout_s: float | None) -> Endpoint[P, R]: ...


def remote(fn: Callable[Concatenate[Any, P], R]) -> Endpoint[P, R]:
    """Declare a view's endpoint: the method's parameters (after self) and its return type, as a
    flow calls it, become an `Endpoint[P, R]` attribute. The method is kept as it is, marked, so
    `declared_endpoints` and the tests can read its signature; its body never runs."""
    setattr(fn, _MARK, True)
    return cast("Endpoint[P, R]", fn)


def declared_endpoints(view: Any) -> dict[str, Callable[..., Any]]:
    """The endpoints a view class declares with `@remote` (its bases' included), by name."""
    found: dict[str, Callable[..., Any]] = {}
    for klass in reversed(view.__mro__):
        for name, value in vars(klass).items():
            if getattr(value, _MARK, False):
                found[name] = value
    return found


class RoleHandle(Protocol):
    """What every role handle has; the base of the typed views, each a Protocol of its own
    (`class Scorer(RoleHandle, Protocol)`), the type `typed(group, View)` gives the role group.

    name: the role's name. world_size: its ranks. endpoints: the endpoint table its daemons sent.
    `endpoint(name)`: an endpoint the view does not declare, untyped.
    """

    name: str
    world_size: int
    endpoints: dict[str, dict[str, Any]]

    def endpoint(self, name: str) -> Endpoint[..., Any]: ...

    @remote
    def describe(self) -> list[dict[str, Any]]:
        """Every rank's role, rank, pid, world size and endpoint names (replicated)."""
