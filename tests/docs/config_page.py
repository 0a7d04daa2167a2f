"""The generated part of docs/configuration.md: every key each built-in flow reads (from the flows'
config dataclasses, reached through the flow loader) and the fields of the role options that are
tables (engine, engine.optim, sampling, vllm, lora); each key's description is the `#:` comment
written above its field, in the most derived class that comments it.

`python -m tests.docs.config_page` rewrites the part between the markers in docs/configuration.md;
tests/docs/test_config_page.py fails when the committed page differs from what this produces.
It knows dataclass fields, the comments above them and which class reads each role-option table;
it does not know what any flow or role does with them. The flow part imports no torch; the role
part imports the role modules (and so torch).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import sys
import textwrap
from importlib import import_module
from pathlib import Path
from typing import Any

from hfrt import FlowConfig
from hfrt.flows import BUILTIN, load_flow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
START = "<!-- generated:config-keys:start (python -m tests.docs.config_page) -->"
END = "<!-- generated:config-keys:end -->"
REGENERATE = "python -m tests.docs.config_page"
#: the role options that are tables → the dataclass whose fields they hold ("module:Class")
ROLE_TABLES: dict[str, str] = {
    "engine": "hfrt.roles.training.engines.base:EngineConfig",
    "engine.optim": "hfrt.roles.training.engines.optim:OptimConfig",
    "sampling": "hfrt.roles.generation.hf:SamplingParams",
    "vllm": "hfrt.roles.generation.vllm_engine:VLLMConfig",
    "lora": "hfrt.roles.training.lora:LoraSpec",
}


class MissingDescription(ValueError):
    """A config field has no `#:` comment in any class that declares it."""


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """The `#:` comment lines right above each annotated field in `cls`'s own body, joined."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a class without source (built in a REPL): nothing to read
        return {}
    lines = source.splitlines()
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    out: dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 2  # the line above the field, 0-based
        while row >= 0 and lines[row].strip().startswith("#:"):
            above.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        if above:
            out[node.target.id] = " ".join(above)
    return out


def describe(cls: type, key: str) -> str:
    """The `#:` comment of `key` in the most derived class of `cls`'s MRO that comments it."""
    for c in cls.__mro__:
        text = field_comments(c).get(key) if dataclasses.is_dataclass(c) else None
        if text:
            return text
    raise MissingDescription(
        f"{cls.__module__}.{cls.__qualname__}.{key} has no description: write a `#:` comment above the "
        f"field (in the class that declares it), then run `{REGENERATE}`")


def default(f: dataclasses.Field[Any]) -> str:
    """The field's default as JSON (what a config file would hold); "required" when it has none, and
    a pointer to its own table when it is a table of another dataclass."""
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    if dataclasses.is_dataclass(value):
        return "its own table"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(cls: type, keys: list[str]) -> list[str]:
    """A markdown table of `keys` of `cls`: type, default, and the key's own description."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key in keys:
        f = fields[key]
        rows.append(f"| `{key}` | `{cell(str(f.type))}` | {cell(default(f))} | {cell(describe(cls, key))} |")
    return rows


def flow_section(name: str) -> list[str]:
    cls = load_flow(name).config_cls
    if cls is None:
        return [f"### `{name}`", "", "No `Config` class: its settings are not checked before launch.", ""]
    if not issubclass(cls, FlowConfig):  # e.g. rm: not an RL flow, none of FlowConfig's keys
        lines = [f"### `{name}`", "", f"`Config` is `{cls.__name__}` (not a `FlowConfig`): only these keys:", ""]
        return lines + table(cls, [f.name for f in dataclasses.fields(cls)]) + [""]
    base = {f.name: f for f in dataclasses.fields(FlowConfig)}
    own = [f.name for f in dataclasses.fields(cls) if f.name not in base or default(f) != default(base[f.name])]
    chain = [c for c in cls.__mro__ if c is not object and issubclass(c, FlowConfig) and c is not FlowConfig]
    bases = " ← ".join(f"`{c.__name__}`" for c in chain[1:] + [FlowConfig])
    lines = [f"### `{name}`", "", f"`Config` is `{cls.__name__}` (on {bases}): every `FlowConfig` key, plus these keys"
             " or defaults:", ""]
    lines += table(cls, own) + [""]
    return lines


def flow_tables() -> list[str]:
    """The page's flow part: FlowConfig's keys, then each built-in flow's own keys and defaults."""
    shared = [f.name for f in dataclasses.fields(FlowConfig)]
    lines = [
        "## Every key, by flow",
        "",
        f"Generated by `{REGENERATE}` from the flows' config dataclasses; do not edit by hand.",
        "A key's description is the `#:` comment above its field in the flow's config class (where",
        "the flow's class only changes the default, in the class that declares the field).",
        "",
        "### Every RL flow (`FlowConfig`)",
        "",
        *table(FlowConfig, shared),
        "",
    ]
    for name in BUILTIN:
        lines += flow_section(name)
    return lines


def role_class(target: str) -> type:
    module, _, name = target.partition(":")
    cls = getattr(import_module(module), name)
    assert dataclasses.is_dataclass(cls), f"{target} is not a dataclass"
    return cls


def role_tables() -> list[str]:
    """The page's role part: the fields of each role option that is a table (ROLE_TABLES)."""
    lines = [
        "## Role options that are tables",
        "",
        f"Generated by `{REGENERATE}` from the dataclasses that read them; do not edit by hand.",
        "Set under `roles.ROLE.options` (`--set roles.actor.options.engine.optim.lr=1e-3`); which role",
        "reads which option, and the options that are single values (`model`, `dtype`, `seed`,",
        "`threads`, ...), are in [roles-and-losses.md](roles-and-losses.md). An unknown field is an",
        "error naming its table.",
        "",
    ]
    for option, target in ROLE_TABLES.items():
        cls = role_class(target)
        lines += [f"### `{option}` (`{cls.__name__}`)", "", *table(cls, [f.name for f in dataclasses.fields(cls)]), ""]
    return lines


def generate() -> str:
    lines = [START, "", *flow_tables(), *role_tables()]
    return "\n".join(lines).rstrip("\n") + "\n" + END + "\n"


def render(page: str) -> str:
    """`page` with its generated part replaced by what the config classes say now."""
    head, sep, rest = page.partition(START)
    if not sep:
        return page.rstrip("\n") + "\n\n" + generate()
    _, sep, tail = rest.partition(END + "\n")
    if not sep:
        raise ValueError(f"{PAGE} has {START} but no {END}")
    return head + generate() + tail


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text()))
    print(f"wrote {PAGE}", file=sys.stderr)
