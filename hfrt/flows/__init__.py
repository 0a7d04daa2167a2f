"""Built-in algorithm scripts and the loader for user flows given as a Python file.

A flow module defines `async def flow(ctl, config) -> dict | None` and may define
`ROLES = {"role": {"impl": "...", "world_size": N, "options": {...}}}`, the daemons it needs when
the controller launches them itself, and `Config`, a class whose `Config.read(dict)` checks the
flow's settings (`hfrt controller` calls it before any daemon starts), and
`roles_for(config, roles) -> roles`, the roles a run with those settings launches when some
setting makes one of them unneeded (default: all).

The config is read once: `Flow.check` reads the dict into the module's Config, `Flow.run` hands
`flow` that typed object (the same one, when the dict did not change in between); a module
without Config gets the dict. (FlowConfig.read returns a config already read as it is, so a flow
that still calls `Config.read(config)` itself keeps working.)
The loader knows module conventions, not algorithms. hfrt.flows imports control/, wire/ and
protocols; never torch, daemon/ or roles (tests/house/test_import_rules.py).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from hfrt.flows.catalog import nearest
from hfrt.flows.lora_table import receivers_follow_actor
from hfrt.flows.reference import without_reference

BUILTIN: dict[str, str] = {
    "ping": "hfrt.flows.recipes.ping",
    "ppo": "hfrt.flows.recipes.ppo",
    "grpo": "hfrt.flows.recipes.grpo",
    "rloo": "hfrt.flows.recipes.rloo",
    "reinforce_pp": "hfrt.flows.recipes.reinforce_pp",
    "remax": "hfrt.flows.recipes.remax",
    "safe_rlhf": "hfrt.flows.recipes.safe_rlhf",
    "dapo": "hfrt.flows.recipes.dapo",
    "grpo_async": "hfrt.flows.recipes.grpo_async",
    "agent_calc": "hfrt.flows.recipes.agent_calc",
    "agent_openai": "hfrt.flows.agent.openai_grpo",
    "agent_replay": "hfrt.flows.agent.replay",
    "rm": "hfrt.flows.recipes.rm",
    "sft": "hfrt.flows.recipes.sft",
    "dpo": "hfrt.flows.recipes.dpo",
    "distill": "hfrt.flows.recipes.distill",
    "distill_async": "hfrt.flows.recipes.distill_async",
}

#: a module's `flow(ctl, config)`: config is its Config read from the dict, or the dict itself
FlowFn = Callable[[Any, Any], Awaitable[dict[str, Any] | None]]


@dataclass(frozen=True)
class Flow:
    """A loaded flow: `fn` is the module's `flow`, `config_cls` its Config (None: it takes the dict)."""

    name: str
    fn: FlowFn
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)
    config_cls: Any = None
    pick_roles: Callable[[dict[str, Any], dict[str, dict[str, Any]]], dict[str, dict[str, Any]]] | None = None
    #: the last config read: (the dict, its typed config), so check then run reads it once
    _read: list[tuple[dict[str, Any], Any]] = field(default_factory=list, compare=False, repr=False)

    async def run(self, ctl: Any, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """Run the flow on `ctl` with `config`, read into the flow's Config when it has one."""
        return await self.fn(ctl, self.read(config) if self.config_cls is not None else config)

    def roles_for(self, config: dict[str, Any], roles: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """The roles a run with `config` launches: `roles` (default: the flow's table) as the
        module's roles_for narrows them, or all of them when it defines none."""
        table = self.roles if roles is None else roles
        table = table if self.pick_roles is None else self.pick_roles(config, table)
        # a LoRA actor stands in for the reference, and its rollout holds the same adapters
        return without_reference(config, receivers_follow_actor(table))

    def check(self, config: Mapping[str, Any]) -> None:
        """Raise ValueError naming the key when the flow's Config rejects `config`."""
        if self.config_cls is not None:
            self.read(config)

    def read(self, config: Mapping[str, Any]) -> Any:
        """`config` read into the flow's Config (ValueError naming the key); a dict equal to the
        one read last gives the same object, so a run checked before launch is not read again."""
        if self.config_cls is None:
            raise ValueError(f"flow {self.name!r} defines no Config: it takes its config as a dict")
        if self._read and self._read[0][0] == config:
            return self._read[0][1]
        typed = self.config_cls.read(config)
        self._read[:] = [(copy.deepcopy(dict(config)), typed)]
        return typed


def unknown_flow(name: str) -> str:
    """The error for a --flow that is neither a built-in name nor a .py path: the nearest built-in
    name (or NAME.py when that file exists) first, then every built-in name."""
    near = f"{name}.py" if Path(f"{name}.py").is_file() else nearest(name, sorted(BUILTIN))
    guess = f" did you mean {near!r}?" if near else ""
    use = "Use" if near else "use"
    return f"unknown flow {name!r}:{guess} {use} one of {', '.join(sorted(BUILTIN))}, or a path to a .py file"


def load_flow(name_or_path: str) -> Flow:
    """A built-in flow by name, or the flow defined in a .py file."""
    module: ModuleType
    if name_or_path in BUILTIN:
        module = importlib.import_module(BUILTIN[name_or_path])
    elif name_or_path.endswith(".py"):
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"flow file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"hfrt_user_flow_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except SyntaxError as exc:  # a typo in the user's file: where, not our traceback
            where = f"{exc.filename or path}, line {exc.lineno}" + (f", column {exc.offset}" if exc.offset else "")
            raise ValueError(f"flow file {where}: {exc.msg}" + (f"\n    {exc.text.rstrip()}" if exc.text else "")) from None
    else:
        raise ValueError(unknown_flow(name_or_path))
    run = getattr(module, "flow", None)
    if run is None or not callable(run):
        raise ValueError(f"flow {name_or_path!r} defines no `async def flow(ctl, config)`")
    roles = getattr(module, "ROLES", {})
    if not isinstance(roles, dict):
        raise ValueError(f"flow {name_or_path!r}: ROLES must be a dict of role → settings")
    config_cls = getattr(module, "Config", None)
    if config_cls is not None and not callable(getattr(config_cls, "read", None)):
        raise ValueError(f"flow {name_or_path!r}: Config must have a read(dict) classmethod")
    pick_roles = getattr(module, "roles_for", None)
    if pick_roles is not None and not callable(pick_roles):
        raise ValueError(f"flow {name_or_path!r}: roles_for must be a function (config, roles) -> roles")
    return Flow(name_or_path, run, roles, config_cls, pick_roles)
