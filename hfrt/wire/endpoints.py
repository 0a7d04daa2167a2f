"""Declaring endpoints: the `@endpoint` decorator, dispatch modes, and a class's endpoint table.

An endpoint is a method of a Daemon subclass. Its dispatch mode and whether it may run
concurrently are declared next to it, so a reader and a type checker both see them. This module
knows nothing of sockets, serving or the controller.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from hfrt.protocols.endpoints import EndpointEntry, Param, ParamKind

F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "__hfrt_endpoint__"


class Dispatch(enum.StrEnum):
    """How a call on a role group is spread over the group's ranks, and how replies come back."""

    #: every rank gets the same arguments; the result is the list of per-rank results.
    REPLICATE = "replicate"
    #: list arguments are split into contiguous chunks by data-parallel rank (ranks sharing a
    #: dp_rank get the same chunk); list results from distinct dp ranks are concatenated in order.
    SPLIT = "split"
    #: only rank 0 runs; the result is its result.
    RANK0 = "rank0"
    #: like SPLIT, but by the rank's coordinate on its *generation* data-parallel axis (verl's
    #: 3D_PROTO for a role that generates at another layout than it trains): the ranks of one
    #: generation tensor/pipeline group get the same rows and one of them answers for the group.
    #: Ranks that declare no generation axis fall back to their data-parallel coordinate.
    SPLIT_GENERATION = "split_generation"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """What the daemon and the controller know about one endpoint."""

    name: str
    dispatch: Dispatch
    concurrent: bool
    is_async: bool
    #: when True the endpoint receives TensorHandle/BatchHandle arguments as they are and pulls
    #: what it wants itself (Daemon.tensor_plane()); by default they arrive as tensors/Batches
    raw_handles: bool
    signature: inspect.Signature
    #: (min, max) positional argument counts when every parameter after `self` is a plain
    #: positional-or-keyword one; then a call with only positional arguments in range is valid
    #: without the slower Signature.bind. None when the signature is anything fancier.
    positional_range: tuple[int, int] | None = None
    #: a streaming endpoint: a generator whose yielded values go back as Partial messages before
    #: the Reply carrying its return value (hfrt.daemon.streaming runs it)
    stream: bool = False
    #: the names a `**kwargs` endpoint accepts there (its options); None: any name
    keywords: tuple[str, ...] | None = None

    def accepts(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Raise TypeError (as a call would) unless args/kwargs fit the endpoint's signature."""
        rng = self.positional_range
        if rng is not None and not kwargs and rng[0] <= len(args) <= rng[1]:
            return
        self.signature.bind(None, *args, **kwargs)

    def describe(self) -> dict[str, Any]:
        """The endpoint-table entry sent in Hello (protocols' EndpointEntry), parameters included,
        so the controller checks a call's arguments before sending it."""
        return EndpointEntry(
            self.dispatch.value, self.concurrent, self.stream, wire_params(self.signature), self.keywords
        ).to_wire()


def endpoint(
    fn: F | None = None,
    *,
    dispatch: Dispatch | str = Dispatch.REPLICATE,
    concurrent: bool = False,
    name: str | None = None,
    raw_handles: bool = False,
    stream: bool = False,
    keywords: Iterable[str] | None = None,
) -> Any:
    """Mark a Daemon method as an endpoint.

    dispatch: how a group call spreads over ranks (see Dispatch).
    concurrent: False (default) runs calls to this daemon one at a time in arrival order; True
        lets this endpoint start as soon as it arrives (async endpoints as tasks, plain functions
        in a thread pool). Arrival order then only fixes the order calls *start* in.
    name: the wire name, defaulting to the method name.
    raw_handles: pass handle arguments through unresolved (the endpoint pulls them itself).
    stream: the method is a (synchronous) generator: each value it yields goes to the caller as a
        Partial message at once, its return value as the Reply. It starts when it arrives and
        advances one step per event-loop turn, so other calls (and a Cancel, which closes it) run
        between its steps; each step runs on the loop thread, never beside another call.
    keywords: for a method taking `**kwargs` that accepts only certain names there (options it
        checks itself), those names: the controller then refuses any other keyword at the call
        site, with a "did you mean". Without it any keyword goes through to the method.
    """

    def wrap(f: F) -> F:
        signature = inspect.signature(f)
        if stream and (concurrent or not inspect.isgeneratorfunction(f)):
            raise TypeError(f"endpoint {f.__qualname__}: stream=True needs a plain generator function (not async, not concurrent)")
        names = None if keywords is None else tuple(sorted(set(keywords)))
        if names is not None and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            raise TypeError(f"endpoint {f.__qualname__}: keywords= names what its **kwargs accepts; it takes no **kwargs")
        setattr(
            f,
            _ATTR,
            EndpointSpec(
                name=name or f.__name__,
                dispatch=Dispatch(dispatch),
                concurrent=concurrent,
                is_async=inspect.iscoroutinefunction(f),
                raw_handles=raw_handles,
                signature=signature,
                positional_range=_positional_range(signature),
                stream=stream,
                keywords=names,
            ),
        )
        return f

    return wrap(fn) if fn is not None else wrap


def _positional_range(signature: inspect.Signature) -> tuple[int, int] | None:
    params = list(signature.parameters.values())[1:]  # after self
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return None
    required = sum(p.default is inspect.Parameter.empty for p in params)
    return required, len(params)


def wire_params(signature: inspect.Signature) -> tuple[Param, ...]:
    """An endpoint method's parameters after `self`, as the Hello's endpoint table carries them."""
    return tuple(
        Param(p.name, ParamKind(p.kind.name.lower()), p.default is not p.empty)
        for p in list(signature.parameters.values())[1:]
    )


def endpoint_table(cls: type) -> dict[str, tuple[EndpointSpec, Callable[..., Any]]]:
    """The endpoints a class declares, own and inherited: wire name → (spec, function)."""
    table: dict[str, tuple[EndpointSpec, Callable[..., Any]]] = {}
    for klass in reversed(cls.__mro__):
        for value in vars(klass).values():
            spec = getattr(value, _ATTR, None)
            if isinstance(spec, EndpointSpec):
                table[spec.name] = (spec, value)
    return table


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """How split rows divide over ranks, the same on both sides of the wire: range(n) as `parts`
    contiguous [start, stop) ranges, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
