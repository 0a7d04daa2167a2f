"""docs/configuration.md lists every key of every built-in flow and every field of the role-option
tables as the config dataclasses say now, each with the `#:` comment written above its own field."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from hfrt import FlowConfig
from hfrt.flows import BUILTIN, load_flow
from tests.docs.config_page import (
    PAGE,
    REGENERATE,
    ROLE_TABLES,
    MissingDescription,
    describe,
    render,
    role_class,
)

_ROW = re.compile(r"^\| `(\w+)` \| .* \| (.*) \|$")


def page_sections() -> dict[str, dict[str, str]]:
    """The generated page's tables: section heading → {key: description cell}."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in PAGE.read_text().splitlines():
        if line.startswith("### "):
            current = sections.setdefault(line[4:], {})
        elif (row := _ROW.match(line)) is not None:
            current[row.group(1)] = row.group(2).replace("\\|", "|")
    return sections


def test_committed_page_is_what_the_generator_writes() -> None:
    page = PAGE.read_text()
    assert render(page) == page, (
        "docs/configuration.md differs from the config dataclasses and their `#:` field comments: "
        f"run `{REGENERATE}` and commit the page"
    )


def test_every_key_of_every_flow_is_on_the_page() -> None:
    page = PAGE.read_text()
    for name in BUILTIN:
        cls = load_flow(name).config_cls
        assert f"### `{name}`" in page
        for f in dataclasses.fields(cls) if cls is not None else ():
            assert f"| `{f.name}` |" in page, f"{name}: key {f.name} is not on the page"


def test_each_row_of_a_flow_table_carries_its_own_fields_comment() -> None:
    sections = page_sections()
    for key, text in sections["Every RL flow (`FlowConfig`)"].items():
        assert text == describe(FlowConfig, key), f"FlowConfig.{key}: the page says {text!r}; run `{REGENERATE}`"
    checked = 0
    for name in BUILTIN:
        cls = load_flow(name).config_cls
        if cls is None:
            continue
        rows = sections[f"`{name}`"]
        assert rows, f"the {name} section has no table"
        for key, text in rows.items():
            assert text == describe(cls, key), f"{name}.{key}: the page says {text!r}; run `{REGENERATE}`"
            checked += 1
    assert checked > 100  # every flow's own keys and defaults, not a handful


def test_the_defaults_a_data_file_brings_are_the_pages() -> None:
    """docs/configuration.md, "Defaults that follow the data": the figures it states."""
    from hfrt.flows.config import DATA_DEFAULTS

    assert DATA_DEFAULTS == {"max_new_tokens": 64, "entropy_coeff": 0.0, "kl_coef": 0.001, "prompts_per_step": 16}
    text = " ".join(PAGE.read_text().split())
    assert ("default to 64 new tokens, no entropy bonus, PPO's KL 0.001 and 16 prompts a step") in text


def test_every_role_option_table_is_on_the_page_with_its_fields_comments() -> None:
    sections = page_sections()
    for option, target in ROLE_TABLES.items():
        cls = role_class(target)
        rows = sections[f"`{option}` (`{cls.__name__}`)"]
        assert list(rows) == [f.name for f in dataclasses.fields(cls)], option
        for key, text in rows.items():
            assert text == describe(cls, key), f"{option}.{key}: the page says {text!r}; run `{REGENERATE}`"


# ------------------------------------------------------------ how a comment finds its field


@dataclass(frozen=True)
class _Base:
    #: the first line of a description
    #: and its second line
    alpha: int = 1
    # a plain comment is not a description
    beta: int = 2
    #: gamma's own description
    gamma: int = 3


@dataclass(frozen=True)
class _Derived(_Base):
    alpha: int = 10  # a new default only: the description stays the base's
    #: gamma, as this class reads it
    gamma: int = 30


def test_a_fields_comment_is_its_description_and_a_subclass_may_override_it() -> None:
    assert describe(_Base, "alpha") == "the first line of a description and its second line"
    assert describe(_Derived, "alpha") == "the first line of a description and its second line"
    assert describe(_Base, "gamma") == "gamma's own description"
    assert describe(_Derived, "gamma") == "gamma, as this class reads it"


def test_a_field_without_a_comment_is_an_error_naming_it_and_the_fix() -> None:
    with pytest.raises(MissingDescription, match=r"_Derived\.beta has no description: write a `#:` comment") as err:
        describe(_Derived, "beta")
    assert REGENERATE in str(err.value)


def test_the_flow_part_of_the_generator_does_not_import_torch() -> None:
    code = "import sys, tests.docs.config_page as p; p.flow_tables(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=PAGE.parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
