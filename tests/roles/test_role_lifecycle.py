"""Built-in roles whose setup never ran (it failed, or the daemon stopped first): teardown and the
state read after setup (the actor's dp axes) work from the defaults each class declares, without
probing for attributes setup would have made. Builds the classes, loads nothing."""

from __future__ import annotations

import pytest

from hfrt.daemon.base import DaemonContext
from hfrt.roles import BUILTIN, resolve_impl

#: the roles that join a process group in setup (and leave it in teardown)
JOINING = ("actor", "actor_ref", "critic", "reference", "reward", "reward_model", "rollout")


@pytest.mark.parametrize("name", sorted(BUILTIN))
async def test_teardown_without_setup_raises_nothing(name: str) -> None:
    daemon = resolve_impl(name)(DaemonContext(name, impl=name))
    await daemon.teardown()  # an AttributeError here: teardown reads what only setup makes


@pytest.mark.parametrize("name", JOINING)
def test_a_role_has_joined_no_group_before_setup(name: str) -> None:
    assert resolve_impl(name)(DaemonContext(name, impl=name))._joined is False  # type: ignore[attr-defined]


def test_the_actors_dp_axes_before_setup_are_the_data_parallel_ones() -> None:
    assert resolve_impl("actor")(DaemonContext("actor", impl="actor")).dp_axes() == {}
