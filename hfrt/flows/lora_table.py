"""How a LoRA actor's `lora` table reaches the roles that must agree with it: a rollout role with no
`lora` of its own gets the actor's, so adapter-only weight syncs fit the rollout without a second
setting (set `roles.rollout.options.lora` to override). It knows role tables by name, nothing of
peft or of how adapters are synced."""

from __future__ import annotations

from typing import Any

#: roles that receive the actor's weights and so must hold the same adapters
RECEIVERS = ("rollout",)


def receivers_follow_actor(roles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`roles` with the actor's `options.lora` copied to every receiver that sets none (a new
    table; `roles` is left as it is)."""
    lora = ((roles.get("actor") or {}).get("options") or {}).get("lora")
    if not lora:
        return roles
    table = dict(roles)
    for name in RECEIVERS:
        role = table.get(name)
        if role is None or "lora" in (role.get("options") or {}):
            continue
        table[name] = {**role, "options": {**(role.get("options") or {}), "lora": dict(lora)}}
    return table
