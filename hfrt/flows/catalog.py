"""The built-in flows as a user meets them at the command line: each one's name and a one-line
description, taken from the opening sentence of its module's docstring (read from the source file,
not imported), and the nearest names to a misspelled one.

`flow_list_help` puts the list at the end of `hfrt controller --help`. It knows where BUILTIN's
modules live and how their docstrings open ("The `name` flow: ..."); nothing of what a flow does.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import shutil
import textwrap
import tokenize
from collections.abc import Mapping
from pathlib import Path

#: a description longer than this is cut at its last clause (", ") that fits, else at a word with "…"
MAX_CHARS = 150
#: where an opening sentence ends (outside parentheses)
STOPS = (". ", "; ", ": ", " — ")


def describe(builtin: Mapping[str, str]) -> dict[str, str]:
    """name → one-line description of each flow in `builtin` (name → module under hfrt.flows), in
    its order; ValueError naming the flow whose module file is missing or has no docstring."""
    here = Path(__file__).parent
    out = {}
    for name, module in builtin.items():
        path = here.joinpath(*module.split(".")[2:]).with_suffix(".py")
        if not path.is_file():
            raise ValueError(f"built-in flow {name!r}: {module} has no source file at {path}")
        doc = _docstring(path)
        if not doc:
            raise ValueError(f"built-in flow {name!r}: {path} opens with no docstring to describe it")
        out[name] = opening(doc, name)
    return out


def _docstring(path: Path) -> str:
    """The module docstring of the file at `path` ("" if it opens with none), from its first token
    alone: the rest of the file is not parsed."""
    with path.open(encoding="utf-8") as file:
        for token in tokenize.generate_tokens(file.readline):
            if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING):
                continue
            text = ast.literal_eval(token.string) if token.type == tokenize.STRING else ""
            return inspect.cleandoc(text) if isinstance(text, str) else ""
    return ""


def opening(doc: str, name: str) -> str:
    """The first sentence of `doc`'s first paragraph on one line, without a leading
    "The `name` flow:", cut to MAX_CHARS."""
    text = " ".join(doc.split("\n\n")[0].split())
    prefix = f"The `{name}` flow: "
    text = text[len(prefix):] if text.startswith(prefix) else text
    text = text[: _first_stop(text, STOPS, len(text))].rstrip(" .")
    if len(text) <= MAX_CHARS:
        return text
    clause = _last_stop(text[:MAX_CHARS], (", ",))
    return text[:clause] if clause else text[: text.rfind(" ", 0, MAX_CHARS)].rstrip(" ,") + "…"


def _stops(text: str, stops: tuple[str, ...]) -> list[int]:
    """Where `stops` occur in `text` outside parentheses (so "et al. 2024" inside them is none)."""
    depth, found = 0, []
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and any(text.startswith(stop, i) for stop in stops):
            found.append(i)
    return found


def _first_stop(text: str, stops: tuple[str, ...], default: int) -> int:
    found = _stops(text, stops)
    return found[0] if found else default


def _last_stop(text: str, stops: tuple[str, ...]) -> int:
    found = _stops(text, stops)
    return found[-1] if found else 0


def listing(builtin: Mapping[str, str], width: int = 100) -> str:
    """The built-in flows as an indented two-column list (name, description wrapped under itself),
    for a command's --help."""
    described = describe(builtin)
    column = max(map(len, described)) + 4
    lines = []
    for name, text in described.items():
        wrapped = textwrap.wrap(text, width=width - column) or [""]
        lines.append(f"  {name:<{column - 2}}{wrapped[0]}")
        lines += [" " * column + more for more in wrapped[1:]]
    return "\n".join(lines)


def nearest(name: str, known: list[str]) -> str | None:
    """The known flow name closest to `name` (difflib's ratio ≥ 0.6), or None."""
    close = difflib.get_close_matches(name, known, n=1)
    return close[0] if close else None


#: the epilog that `flow_list_help`'s formatter replaces with the list of flows
EPILOG = "built-in flows (--flow NAME)"


def flow_list_help(builtin: Mapping[str, str]) -> type[argparse.HelpFormatter]:
    """An argparse formatter class for a parser whose epilog is EPILOG: the epilog becomes the list
    of `builtin`'s flows (`listing`), read only when the help is shown, not each time the parser is built."""

    class FlowListHelp(argparse.RawDescriptionHelpFormatter):
        def add_text(self, text: str | None) -> None:
            if text == EPILOG:
                width = max(60, min(shutil.get_terminal_size().columns - 2, 120))
                text = f"{text}:\n{listing(builtin, width=width)}"
            super().add_text(text)

    return FlowListHelp
