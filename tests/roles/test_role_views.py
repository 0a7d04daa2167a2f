"""The typed views flows call the built-in roles through (hfrt.wire.role_views) against the daemon
classes themselves, so the two cannot drift: the same endpoints; per endpoint the same parameters
(names, kinds, defaults) and types, a daemon's `Batch` read as the controller's `BatchHandle`; the
keyword options a `**options` endpoint accepts (its `keywords=`) equal to the view's TypedDict,
typed as the daemons' own option dataclasses; and each result as the endpoint's dispatch mode
collects it (rank 0's value, a list per rank, one BatchHandle over the data-parallel ranks).
Imports the daemon classes (torch), starts none.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any, ForwardRef

import pytest

from hfrt.roles import BUILTIN, resolve_impl
from hfrt.roles.components.advantage import AdvantageParams
from hfrt.roles.generation.hf import SamplingParams
from hfrt.wire import role_views
from hfrt.wire.endpoints import Dispatch, EndpointSpec, endpoint_table
from hfrt.wire.handles import RoleHandle, declared_endpoints
from hfrt.wire.loss_options import ActorLoss, CriticLoss, UpdateSchedule

#: implementation name → the view a flow types it with (probe: a benchmark's role, untyped on purpose)
VIEWS: dict[str, type[RoleHandle]] = {
    "actor": role_views.Actor, "actor_ref": role_views.Actor, "critic": role_views.Critic,
    "reference": role_views.Reference, "reward": role_views.Reward, "reward_model": role_views.RewardModel,
    "rollout": role_views.Rollout, "echo": role_views.Echo,
}
UNTYPED = {"probe"}
#: a view's option TypedDict → the daemons' dataclasses whose fields type those options
SOURCES: dict[str, tuple[type, ...]] = {
    "Sampling": (SamplingParams,), "TurnSampling": (SamplingParams,), "ActorUpdate": (ActorLoss, UpdateSchedule),
    "CriticUpdate": (CriticLoss, UpdateSchedule), "Advantages": (AdvantageParams,),
}


def controller_side(annotation: str) -> str:
    """A daemon-side annotation as the controller sees the value: batches travel as handles."""
    return re.sub(r"\bBatch\b", "BatchHandle", annotation)


def collected(spec: EndpointSpec, returned: str) -> str:
    """What a call dispatched by the endpoint's mode gives, for a daemon method returning `returned`
    (hfrt.control.dispatch.collect); a streaming endpoint's result is its generator's return value."""
    if spec.stream:
        return top_level_args(returned.removeprefix("Generator[").removesuffix("]"))[2]
    one = controller_side(returned)
    if spec.dispatch is Dispatch.RANK0:
        return one
    if spec.dispatch is Dispatch.REPLICATE:
        return f"list[{one}]"
    return one if one == "BatchHandle" or one.startswith("list[") else f"list[{one}]"


def top_level_args(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def as_text(annotation: Any) -> str:
    return annotation.__forward_arg__ if isinstance(annotation, ForwardRef) else str(annotation)


def options_of(fn: Callable[..., Any]) -> tuple[str, dict[str, str]] | None:
    """(TypedDict name, {option: type}) of a view method's `**options: Unpack[...]`; None without one."""
    var = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.VAR_KEYWORD]
    if not var:
        return None
    unpacked = typing.get_type_hints(fn, vars(role_views), include_extras=True)[var[0].name]
    options = typing.get_args(unpacked)[0]
    return options.__name__, {key: as_text(value) for key, value in options.__annotations__.items()}


def parameters(fn: Callable[..., Any], *, daemon: bool) -> list[tuple[str, str, bool, Any, str]]:
    """(name, kind, has default, default, type as the controller sees it) after self; **kwargs apart."""
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is p.VAR_KEYWORD:
            continue
        annotation = controller_side(p.annotation) if daemon else p.annotation
        out.append((p.name, p.kind.name, p.default is not p.empty, p.default, annotation))
    return out


def differences(spec: EndpointSpec, daemon_fn: Callable[..., Any], view_fn: Callable[..., Any]) -> list[str]:
    where, found = spec.name, []
    mine, theirs = parameters(view_fn, daemon=False), parameters(daemon_fn, daemon=True)
    if mine != theirs:
        found.append(f"{where}: parameters {mine} in the view, {theirs} on the daemon")
    expected = collected(spec, inspect.signature(daemon_fn).return_annotation)
    if inspect.signature(view_fn).return_annotation != expected:
        found.append(f"{where}: returns {inspect.signature(view_fn).return_annotation!r}, the dispatch gives {expected!r}")
    options = options_of(view_fn)
    accepted = set(spec.keywords or ())
    if (options is None) != (spec.keywords is None) or (options and set(options[1]) != accepted):
        found.append(f"{where}: options {sorted(options[1]) if options else None}, the daemon accepts {sorted(accepted) or None}")
    if options:
        types = {f.name: f.type for cls in SOURCES[options[0]] for f in dataclasses.fields(cls)}
        wrong = {k: (v, types[k]) for k, v in options[1].items() if k in types and v != types[k]}
        if wrong:
            found.append(f"{where}: option types (view, daemon) differ: {wrong}")
    return found


def test_every_built_in_role_has_a_view() -> None:
    assert set(VIEWS) | UNTYPED == set(BUILTIN)


@pytest.mark.parametrize("impl", sorted(VIEWS))
def test_the_view_matches_the_daemon_class(impl: str) -> None:
    table, view = endpoint_table(resolve_impl(impl)), VIEWS[impl]
    declared = declared_endpoints(view)
    assert sorted(declared) == sorted(table), f"{view.__name__} declares {sorted(declared)}; {impl} has {sorted(table)}"
    found = [line for name, (spec, fn) in table.items() for line in differences(spec, fn, declared[name])]
    assert found == [], "\n".join(found)


def test_a_drifted_signature_is_found() -> None:
    """The comparison itself: a daemon whose generate lost an option and whose update returns
    something else is told apart from the view."""
    from hfrt.wire.endpoints import endpoint

    class Drifted:
        @endpoint(dispatch=Dispatch.SPLIT_GENERATION, keywords=("n", "seed"))
        def generate(self, batch: Any, *extra: Any, chunk: int | None = None, chunks: int = 2, **sampling: Any) -> Any: ...

        @endpoint(dispatch=Dispatch.SPLIT)
        def update(self, batch: Any, *extra: Any, **loss: Any) -> Any: ...

    table = endpoint_table(Drifted)
    declared = declared_endpoints(role_views.Actor)
    found = [line for name, (spec, fn) in table.items() for line in differences(spec, fn, declared[name])]
    assert any(line.startswith("generate: parameters") and "chunks" in line for line in found), found
    assert any(line.startswith("generate: options") for line in found), found
    assert any(line.startswith("update: returns") for line in found), found


def test_a_view_is_a_type_not_a_handle() -> None:
    with pytest.raises(TypeError, match="Protocols cannot be instantiated"):
        role_views.Actor()
