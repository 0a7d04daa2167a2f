"""reference_from_actor (hfrt/flows/reference.py): with LoRA on the actor every built-in flow with a
reference role launches none (unless reference_from_actor = false), and get_roles hands the flows
the actor's compute_ref_log_prob in its place. No daemons: the role table and a stand-in controller."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hfrt.flows import BUILTIN, load_flow
from hfrt.flows.reference import ActorReference, from_actor, without_reference
from hfrt.flows.trainer import get_roles

WITH_REFERENCE = [name for name in BUILTIN if "reference" in load_flow(name).roles]


def lora_roles(name: str) -> dict[str, dict[str, Any]]:
    roles = copy.deepcopy(load_flow(name).roles)
    roles["actor"].setdefault("options", {})["lora"] = {"rank": 8}
    return roles


@pytest.mark.parametrize("name", WITH_REFERENCE)
def test_a_lora_actor_replaces_the_reference_daemon(name: str) -> None:
    flow = load_flow(name)
    assert "reference" in flow.roles_for({}, copy.deepcopy(flow.roles))  # no LoRA: launched
    assert "reference" not in flow.roles_for({}, lora_roles(name))
    assert "reference" in flow.roles_for({"reference_from_actor": False}, lora_roles(name))
    if flow.config_cls is not None:  # the setting is a key of the flow's config
        assert flow.config_cls.read({"reference_from_actor": False}).reference_from_actor is False


def test_the_setting_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="config reference_from_actor='no': expected true or false"):
        from_actor({"reference_from_actor": "no"}, lora_roles("grpo"))
    assert without_reference({}, {"actor": {}}) == {"actor": {}}


class Endpoint:
    def __init__(self, name: str) -> None:
        self.name = name


class Group:
    def __init__(self, name: str) -> None:
        self.name = name

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(f"{self.name}.{name}")


class Controller:
    def __init__(self, *launched: str) -> None:
        self.launched = launched

    def daemons(self, role: str | None = None) -> list[str]:
        return [r for r in self.launched if r == role]

    async def role(self, name: str, *, timeout_s: float = 0) -> Group:
        assert name in self.launched, f"{name} was never launched: waiting for it would time out"
        return Group(name)


async def test_get_roles_gives_the_actor_as_the_reference_when_none_was_launched() -> None:
    roles = await get_roles(Controller("actor", "reward"), "actor", "reference", "reward")
    assert list(roles) == ["actor", "reference", "reward"]
    reference = roles["reference"]
    assert isinstance(reference, ActorReference) and reference.compute_log_prob.name == "actor.compute_ref_log_prob"
    launched = await get_roles(Controller("actor", "reference", "reward"), "actor", "reference", "reward")
    assert isinstance(launched["reference"], Group)


class LateController(Controller):
    """A session that launched a reference daemon which has not said hello yet (the actor was first)."""

    def __init__(self, *launched: str) -> None:
        super().__init__(*launched)
        self.launched_roles = frozenset(launched)

    def daemons(self, role: str | None = None) -> list[str]:
        return [] if role == "reference" else super().daemons(role)


async def test_get_roles_waits_for_a_launched_reference_that_has_not_said_hello_yet() -> None:
    roles = await get_roles(LateController("actor", "reference", "reward"), "actor", "reference", "reward")
    assert isinstance(roles["reference"], Group) and roles["reference"].name == "reference"  # not the actor's stand-in
    alone = await get_roles(LateController("actor", "reward"), "actor", "reference", "reward")
    assert isinstance(alone["reference"], ActorReference)


def test_a_rollout_without_its_own_lora_gets_the_actors() -> None:
    flow = load_flow("grpo_async")
    table = flow.roles_for({}, lora_roles("grpo_async"))
    assert table["rollout"]["options"]["lora"] == {"rank": 8} and "reference" not in table
    assert "lora" not in flow.roles["rollout"].get("options", {})  # the flow's own table is untouched
    own = lora_roles("grpo_async")
    own["rollout"]["options"]["lora"] = {"rank": 2}
    assert flow.roles_for({}, own)["rollout"]["options"]["lora"] == {"rank": 2}  # a rollout's own table wins
    assert "lora" not in load_flow("grpo_async").roles_for({})["rollout"]["options"]  # no LoRA actor: nothing added
