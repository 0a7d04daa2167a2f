"""A role group typed as a view (hfrt.wire.handles): `typed(group, Actor)` checks that the group's
daemons have every endpoint the view declares and returns the group itself, typed as the view,
so a type checker verifies a flow's calls while the group keeps checking each call at run time.

It knows the group's endpoint table and the view's declarations; nothing of sending calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from hfrt.control.call_check import did_you_mean
from hfrt.wire.errors import UnknownEndpoint
from hfrt.wire.handles import RoleHandle, declared_endpoints

if TYPE_CHECKING:
    from hfrt.control.group import EndpointRef
    from hfrt.wire.handles import Endpoint

H = TypeVar("H", bound=RoleHandle)


class Group(Protocol):
    """What `typed` reads of a role group (a RoleGroup, or a stand-in such as the LoRA actor's reference)."""

    name: str

    @property
    def endpoints(self) -> Mapping[str, Any]: ...


def typed(group: Group, view: Callable[..., H]) -> H:
    """`group`, typed as `view` (a view class: a Protocol, hence `Callable[..., H]`, which mypy lets a
    Protocol class be where `type[H]` would not); UnknownEndpoint, naming the view and the role,
    when its daemons lack an endpoint the view declares (a view of another role, or daemons of
    another kind)."""
    have = group.endpoints
    missing = [name for name in declared_endpoints(view) if name not in have]
    if missing:
        hints = [f"{name} ({hint})" if (hint := did_you_mean(name, have)) else name for name in missing]
        raise UnknownEndpoint(
            f"role {group.name!r} lacks endpoint(s) {', '.join(hints)} that the view {getattr(view, '__name__', view)} declares; "
            f"its daemons have: {', '.join(sorted(have))}"
        )
    return cast(H, group)


if TYPE_CHECKING:

    def _an_endpoint_ref_is_a_typed_endpoint(ref: EndpointRef) -> Endpoint[..., Any]:
        return ref  # the type checker holds the runtime class to the face flows are typed against
