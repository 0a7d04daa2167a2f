"""The built-in flows' catalog (hfrt.flows.catalog): one-line descriptions from module docstrings,
the `hfrt controller --help` listing, and the nearest name to a misspelled flow."""

from __future__ import annotations

import pytest

from hfrt.flows import BUILTIN, load_flow, unknown_flow
from hfrt.flows.catalog import MAX_CHARS, describe, listing, nearest, opening


def test_every_builtin_flow_has_a_one_line_description() -> None:
    described = describe(BUILTIN)
    assert list(described) == list(BUILTIN)
    for name, text in described.items():
        assert text and "\n" not in text and len(text) <= MAX_CHARS + 1, (name, text)
        assert not text.startswith("The `"), (name, text)  # the "The `name` flow:" opening is dropped


def test_opening_is_the_first_sentence_outside_parentheses() -> None:
    doc = "The `x` flow: RLOO (Ahmadian et al. 2024) on the addition\ntask — n samples. More text.\n\nDetails."
    assert opening(doc, "x") == "RLOO (Ahmadian et al. 2024) on the addition task"
    assert opening("The `y` flow: proves the runtime end to end.", "y") == "proves the runtime end to end"


def test_a_long_opening_is_cut_at_a_clause_then_at_a_word() -> None:
    clauses = "train a model on pairs, then validate it" + " and again" * 20
    assert opening(clauses, "z") == "train a model on pairs"
    words = "word " * 60
    cut = opening(words, "z")
    assert cut.endswith("…") and len(cut) <= MAX_CHARS + 1 and not cut[:-1].endswith(" ")


def test_listing_puts_each_flow_on_its_own_line() -> None:
    text = listing(BUILTIN, width=100)
    starts = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert starts == list(BUILTIN)
    assert all(len(line) <= 100 for line in text.splitlines())


def test_a_missing_docstring_names_the_flow() -> None:
    with pytest.raises(ValueError, match="built-in flow 'nothing': hfrt.flows.recipes.nothing has no source file"):
        describe({"nothing": "hfrt.flows.recipes.nothing"})


@pytest.mark.parametrize("typo, near", [("ppoo", "ppo"), ("grpo-async", "grpo_async"), ("safe-rlhf", "safe_rlhf"), ("zzz", None)])
def test_nearest_builtin_name(typo: str, near: str | None) -> None:
    assert nearest(typo, sorted(BUILTIN)) == near


def test_unknown_flow_suggests_the_nearest_and_lists_all() -> None:
    known = ", ".join(sorted(BUILTIN))
    with pytest.raises(ValueError) as caught:
        load_flow("ppoo")
    assert str(caught.value) == f"unknown flow 'ppoo': did you mean 'ppo'? Use one of {known}, or a path to a .py file"
    assert unknown_flow("nope") == f"unknown flow 'nope': use one of {known}, or a path to a .py file"


def test_unknown_flow_suggests_the_py_file_beside_it(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    (tmp_path / "my_flow.py").write_text("async def flow(ctl, config):\n    return {}\n")  # type: ignore[operator]
    assert unknown_flow("my_flow").startswith("unknown flow 'my_flow': did you mean 'my_flow.py'? Use one of ")
