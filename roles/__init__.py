"""Role daemon implementations and the lookup from an implementation name to its Daemon class.

Built-in names map to classes here; anything else is "package.module:Class" or "path/file.py:Class".
roles/ imports hfrt.daemon, hfrt.wire, protocols, torch and the model libraries; never the
controller side (hfrt.control, hfrt.flows), deploy or bench.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from hfrt.daemon.base import Daemon

#: Built-in implementation names → "module:Class".
BUILTIN: dict[str, str] = {
    "echo": "hfrt.roles.diagnostic.echo:EchoDaemon",
    "probe": "hfrt.roles.diagnostic.probe:ProbeDaemon",
    "actor": "hfrt.roles.actor:ActorDaemon",
    "critic": "hfrt.roles.critic:CriticDaemon",
    "reference": "hfrt.roles.reference:ReferenceDaemon",
    "reward": "hfrt.roles.reward:RewardDaemon",
    "reward_model": "hfrt.roles.reward_model:RewardModelDaemon",
    "actor_ref": "hfrt.roles.colocated:ActorRefDaemon",
    "rollout": "hfrt.roles.rollout:RolloutDaemon",
}


def resolve_impl(name: str) -> type[Daemon]:
    """The Daemon subclass for a built-in name, "module:Class", or "file.py:Class"."""
    target = BUILTIN.get(name, name)
    module_name, sep, class_name = target.rpartition(":")
    if not sep or not module_name or not class_name:
        known = ", ".join(sorted(BUILTIN))
        raise ValueError(f"unknown daemon implementation {name!r}: use one of {known}, or module:Class")
    if module_name.endswith(".py"):
        path = Path(module_name)
        spec = importlib.util.spec_from_file_location(f"hfrt_user_role_{path.stem}", path)
        if spec is None or spec.loader is None or not path.exists():
            raise ValueError(f"daemon implementation file {path} does not exist")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Daemon)):
        raise ValueError(f"{target}: {class_name} is not a hfrt Daemon subclass")
    return cls
