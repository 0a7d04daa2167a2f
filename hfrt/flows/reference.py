"""Where a flow's reference log-probs come from: a reference daemon, or — with LoRA on the actor
(`roles.actor.options.lora`) — the actor itself with its adapters off (the base model), so no
reference daemon and no second copy of the weights exist (verl's ref_in_actor).

`reference_from_actor` (a flow setting, default true) decides it before launch: `without_reference`
drops the reference role from what a run launches; at run time `reference_role` gives the flows a
stand-in whose `compute_log_prob` is the actor's `compute_ref_log_prob`. It knows role tables and
role groups by name; nothing of torch or of how log-probs are computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfrt.control.typed_roles import typed
from hfrt.wire.handles import Endpoint, RoleHandle
from hfrt.wire.role_views import Reference

SETTING = "reference_from_actor"


def from_actor(config: Mapping[str, Any], roles: Mapping[str, Mapping[str, Any]]) -> bool:
    """True when the run's reference log-probs come from the actor: it trains LoRA adapters and
    the `reference_from_actor` setting is not false."""
    setting = config.get(SETTING, True)
    if not isinstance(setting, bool):
        raise ValueError(f"config {SETTING}={setting!r}: expected true or false")
    actor = roles.get("actor") or {}
    return setting and bool((actor.get("options") or {}).get("lora"))


def without_reference(config: Mapping[str, Any], roles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The roles a run launches: without the reference role when the actor stands in for it."""
    if "reference" in roles and from_actor(config, roles):
        return {name: settings for name, settings in roles.items() if name != "reference"}
    return roles


class ActorReference:
    """The reference role's face over a LoRA actor: compute_log_prob(rollout, ...) is the actor's
    compute_ref_log_prob (adapters off), same dispatch and arguments, same `ref_log_prob` column;
    compute_pair_log_probs(pairs, ...) is its compute_ref_pair_log_probs (the dpo flow's);
    `describe` is the actor's."""

    name = "reference"

    def __init__(self, actor: RoleHandle) -> None:
        self.actor = actor
        self.compute_log_prob: Endpoint[..., Any] = actor.endpoint("compute_ref_log_prob")
        self.compute_pair_log_probs: Endpoint[..., Any] = actor.endpoint("compute_ref_pair_log_probs")
        self.describe: Endpoint[..., Any] = actor.endpoint("describe")

    @property
    def endpoints(self) -> dict[str, Any]:
        return {"compute_log_prob": self.compute_log_prob, "compute_pair_log_probs": self.compute_pair_log_probs,
                "describe": self.describe}

    def __repr__(self) -> str:
        return f"ActorReference({self.actor!r})"


def reference_role(ctl: Any, actor: RoleHandle) -> Reference | None:
    """The reference a flow calls: None when reference daemons said hello (use them), else the
    actor standing in, typed as the Reference view (a run without a reference role launches none;
    the actor refuses clearly if it has no LoRA)."""
    if ctl.daemons("reference"):
        return None
    return typed(ActorReference(actor), Reference)
