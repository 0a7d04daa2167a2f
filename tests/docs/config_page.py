"""The generated part of docs/configuration.md: every key each built-in flow reads, from the flows'
config dataclasses (their fields and docstrings), reached through the flow loader only.

`python -m tests.docs.config_page` rewrites the part between the markers in docs/configuration.md;
tests/docs/test_config_page.py fails when the committed page differs from what this produces.
It knows dataclass fields and docstring sentences; it does not know any flow or module path.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from hfrt import FlowConfig
from hfrt.flows import BUILTIN, load_flow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
START = "<!-- generated:config-keys:start (python -m tests.docs.config_page) -->"
END = "<!-- generated:config-keys:end -->"
#: a docstring splits into sentences at ". " before a capital, a word, a backtick or a key
_SENTENCE = re.compile(r"(?<=[.])\s+(?=[A-Za-z_`(\"])")
_ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "etc.")


def sentences(doc: str | None) -> list[str]:
    """A docstring's sentences, whitespace collapsed (abbreviations do not end a sentence)."""
    text = " ".join((doc or "").split())
    for i, abbr in enumerate(_ABBREVIATIONS):
        text = text.replace(abbr, f"\0{i}\0")
    parts = _SENTENCE.split(text)
    out = []
    for part in parts:
        for i, abbr in enumerate(_ABBREVIATIONS):
            part = part.replace(f"\0{i}\0", abbr)
        if part.strip():
            out.append(part.strip())
    return out


def mentions(sentence: str, key: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", sentence) is not None


def introduced_by(cls: type, key: str) -> type:
    """The most basic class of `cls`'s MRO that declares `key`."""
    owners = [c for c in cls.__mro__ if key in c.__dict__.get("__annotations__", {})]
    return owners[-1]


def describe(cls: type, key: str) -> str:
    """The first docstring sentence that mentions `key`: in the class that introduced it, else in
    any class of the MRO (most derived first); "" when no docstring names it."""
    order = [introduced_by(cls, key)] + [c for c in cls.__mro__ if c is not object]
    for test in (leads, mentions):  # a sentence that opens with "key:" beats one that names it
        for c in order:
            for sentence in sentences(c.__doc__):
                if test(sentence, key):
                    return sentence
    return ""


def leads(sentence: str, key: str) -> bool:
    """Whether the sentence opens with `key:` (or `a / key:`, `a, key and b:`)."""
    lead, sep, _ = sentence.partition(":")
    return bool(sep) and len(lead.split()) <= 6 and key in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", lead)


def default(f: dataclasses.Field[Any]) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(cls: type, keys: list[str]) -> list[str]:
    """A markdown table of `keys` of `cls`: type, default, and the sentence that describes it (a
    sentence already shown for an earlier key of the table points to that key instead)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    shown: dict[str, str] = {}
    for key in keys:
        text = describe(cls, key)
        if text and text in shown:
            text = f"see `{shown[text]}`"
        elif text:
            shown[text] = key
        rows.append(f"| `{key}` | `{cell(str(fields[key].type))}` | {cell(default(fields[key]))} | {cell(text) or '—'} |")
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


def generate() -> str:
    shared = [f.name for f in dataclasses.fields(FlowConfig)]
    lines = [
        START,
        "",
        "## Every key, by flow",
        "",
        "Generated from the flows' config dataclasses (fields and docstrings); do not edit by hand.",
        "A key's description is the docstring sentence that names it.",
        "",
        "### Every RL flow (`FlowConfig`)",
        "",
        *table(FlowConfig, shared),
        "",
    ]
    for name in BUILTIN:
        lines += flow_section(name)
    return "\n".join(lines).rstrip("\n") + "\n" + END + "\n"


def render(page: str) -> str:
    """`page` with its generated part replaced by what the config classes say now."""
    head, sep, rest = page.partition(START)
    if not sep:
        return page.rstrip("\n") + "\n\n" + generate()
    _, sep, tail = rest.partition(END + "\n")
    assert sep, f"{PAGE} has {START} but no {END}"
    return head + generate() + tail


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text()))
    print(f"wrote {PAGE}", file=sys.stderr)
