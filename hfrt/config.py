"""A run's configuration as `hfrt controller` assembles it: a TOML or YAML file (`--config`), then
`--set key=value` overrides, checked against the flow's config class and role table before any
daemon starts, and saved as RUN_DIR/config.json (every setting, defaults included, and the
roles: `{"flow": {...}, "roles": {...}}`) so `--resume` can read it back and `--config
RUN_DIR/config.json` runs it again.

Layout (the same in a file and in --set's dotted keys): flow settings at the top level, role
overrides under `roles` — e.g. `steps = 50` and `[roles.actor.options.engine.optim] lr = 1e-3`,
or `--set steps=50 --set roles.actor.options.engine.optim.lr=1e-3`. A role override is merged
key by key into the flow's own role table; a role the flow does not have must give its `impl`.
It knows the file formats and merge rules; what the keys mean is the flow's and the roles' business.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfrt.flows.config import did_you_mean

ROLE_KEYS = frozenset({"impl", "world_size", "dp_size", "options"})


class ConfigError(ValueError):
    """A configuration that cannot run, naming the file or key at fault."""


@dataclass
class RunConfig:
    flow: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"flow": self.flow, "roles": self.roles}, indent=2, default=str)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A .toml, .yaml or .yml file as a dict."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
    text = file.read_text()
    suffix = file.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            data: Any = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"config file {file}: reading YAML needs PyYAML (pip install pyyaml)") from None
            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {file}: use .toml, .yaml/.yml or .json")
    except ConfigError:
        raise
    except Exception as exc:  # tomllib / yaml / json parse errors
        raise ConfigError(f"config file {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file}: the top level must be a table of settings")
    if set(data) == {"flow", "roles"} and isinstance(data["flow"], dict):
        return {**data["flow"], "roles": data["roles"]}  # a run's saved RUN_DIR/config.json
    return data


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` items as a nested dict (dots nest); a value is parsed as JSON when it can be."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set expects key=value (dots nest), got {item!r}")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} was already given a value")
        node[leaf] = value
    return out


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: tables merge key by key, anything else in `over` replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build(
    flow_roles: Mapping[str, Mapping[str, Any]],
    *,
    file: str | Path | None = None,
    sets: list[str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """base (a saved config.json's content) < file < --set, split into flow settings and roles."""
    layered: dict[str, Any] = {}
    if base:
        layered = merge(layered, {**base.get("flow", {}), "roles": base.get("roles", {})})
    if file:
        layered = merge(layered, read_config_file(file))
    layered = merge(layered, parse_set(sets or []))
    overrides = layered.pop("roles", {}) or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError("'roles' must be a table of role name → settings")
    roles = {name: copy.deepcopy(dict(settings)) for name, settings in flow_roles.items()}
    for name, settings in overrides.items():
        if not isinstance(settings, Mapping):
            raise ConfigError(f"roles.{name} must be a table (impl, world_size, dp_size, options)")
        unknown = sorted(set(settings) - ROLE_KEYS)
        if unknown:
            raise ConfigError(f"roles.{name}: unknown key(s) {unknown}{did_you_mean(unknown, ROLE_KEYS)}; a role takes {sorted(ROLE_KEYS)}")
        if name not in roles and "impl" not in settings:
            raise ConfigError(f"roles.{name}: the flow has no role {name!r}, so its impl must be given"
                              f"{did_you_mean([name], roles)}; its roles: {sorted(roles)}")
        roles[name] = merge(roles.get(name, {}), settings)
    for name, settings in roles.items():
        _check_role(name, settings)
    return RunConfig(layered, roles)


def _check_role(name: str, settings: Mapping[str, Any]) -> None:
    for key in ("world_size", "dp_size"):
        value = settings.get(key, 1 if key == "world_size" else -1)
        if not isinstance(value, int) or isinstance(value, bool) or (key == "world_size" and value < 1):
            raise ConfigError(f"roles.{name}.{key}={value!r}: expected a positive integer")
    if not isinstance(settings.get("impl", name), str):
        raise ConfigError(f"roles.{name}.impl must be a string")
    if not isinstance(settings.get("options", {}), Mapping):
        raise ConfigError(f"roles.{name}.options must be a table")


def role_overrides(*, file: str | Path | None = None, sets: list[str] | None = None) -> dict[str, Any]:
    """The `roles` part of --config and --set alone (not of a resumed run's saved config)."""
    layered = merge(read_config_file(file) if file else {}, parse_set(sets or []))
    roles = layered.get("roles") or {}
    return dict(roles) if isinstance(roles, Mapping) else {}


def refuse_role_overrides(overrides: Mapping[str, Any], running: Mapping[str, Mapping[str, Any]], source: str) -> None:
    """For a run attached to daemons already running (`--attach`): raise ConfigError naming every
    role setting given (`overrides`, from `source`: --config/--set's roles, or --role's) that the
    daemons were not started with (`running`: attach.json's settings; a role it does not describe
    counts as not matching). Such a setting could not apply, and config.json must not record it."""
    given = []
    for name, settings in overrides.items():
        for key, value in _leaves(settings, f"roles.{name}"):
            have = _setting(running[name], name, key.split(".")[2:]) if name in running else _MISSING
            if have != value:
                given.append(f"{key}={value!r}" + ("" if have is _MISSING else f" (they have {have!r})"))
    if given:
        raise ConfigError(
            f"--attach: the daemons already running were started with their own role settings, so these from "
            f"{source} cannot apply: {', '.join(given)}; drop them, or run without --attach to launch daemons with them"
        )


def _leaves(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping) and value:
        return [leaf for key, sub in value.items() for leaf in _leaves(sub, f"{prefix}.{key}")]
    return [(prefix, value)]


def _setting(settings: Mapping[str, Any], name: str, path: list[str]) -> Any:
    node: Any = {"impl": name, "world_size": 1, "dp_size": -1, **settings}
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def check_role_options(roles: Mapping[str, Mapping[str, Any]], timeout_s: float = 120.0) -> None:
    """Have every role's implementation check its options (hfrt.roles.check, in a child process
    so this one never imports torch); raise ConfigError listing every problem."""
    import subprocess
    import sys

    try:
        out = subprocess.run(
            [sys.executable, "-m", "hfrt.roles.check"], input=json.dumps(roles), capture_output=True, text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"checking the role options took over {timeout_s:.0f} s") from None
    if out.returncode != 0:
        raise ConfigError(f"could not check the role options: {out.stderr.strip()[-2000:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if found:
        raise ConfigError("; ".join(found))

