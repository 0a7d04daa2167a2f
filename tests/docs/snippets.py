"""Fenced code blocks of README.md and docs/*.md, with the HTML comment that says how a test uses each.

Directives (an HTML comment on the line(s) just above the fence):
- `<!-- not run: REASON -->`: only for reading; its test skips and prints REASON.
- `<!-- tested-by: PATH -->`: a test of its own (PATH) cuts the block out and runs it.
- `<!-- run: flow [ARGS] -->` (python): saved as a file and run with `hfrt controller --flow FILE ARGS`.
- `<!-- run: module NAME -->` (python): saved as NAME beside the page's other runnable blocks.
- `<!-- checked: WHAT -->` (toml): parsed and checked as WHAT (run config for FLOW, cluster spec, plan file).
- none: a ```python block runs as a script; a ```bash block runs line by line, in a scratch folder
  holding links to the repository's `deploy/` and `bench/`; a ```toml block must parse.
It knows markdown fences and these comments, nothing about what the blocks do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*(not run|tested-by|run|checked)\s*:?\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    text: str
    directive: str = ""  # "not run", "tested-by", "run", "checked" or ""
    arg: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every top-level fenced block of a page (indented fences inside list items are text)."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        directive, arg = _directive_above(lines, start)
        out.append(Block(str(page.relative_to(ROOT)), start + 1, fence.group(1), "\n".join(body) + "\n", directive, arg))
        i += 1
    return out


def _directive_above(lines: list[str], start: int) -> tuple[str, str]:
    """The nearest directive among the HTML comments directly above line `start`."""
    j = start - 1
    while j >= 0 and lines[j].startswith("<!--"):
        found = _DIRECTIVE.match(lines[j])
        if found:
            return found.group(1), found.group(2)
        j -= 1
    return "", ""


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def commands(text: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank lines and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in (raw.strip() for raw in joined.splitlines()) if line and not line.startswith("#")]
