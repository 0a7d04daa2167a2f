"""The linter runs as part of the suite: ruff with the rules configured in pyproject.toml, over every
package the type checker reads plus the tests (tests/house/test_types.py runs the type checker)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def linted_paths() -> list[str]:
    """The folders ruff checks: mypy's `files` (the whole package) and the tests."""
    return [*PYPROJECT["tool"]["mypy"]["files"], "tests"]


def test_lint_covers_the_package_and_the_tests() -> None:
    paths = linted_paths()
    assert {"hfrt", "protocols", "roles", "deploy", "bench", "tests"} <= set(paths), paths
    assert all((ROOT / p).is_dir() for p in paths), paths


def test_ruff_is_pinned_in_the_test_extra() -> None:
    pins = [r for r in PYPROJECT["project"]["optional-dependencies"]["test"] if r.startswith("ruff")]
    assert len(pins) == 1 and "==" in pins[0], f"the test extra should pin ruff exactly once, has {pins}"


def test_ruff_finds_no_violations() -> None:
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0, f"ruff is not installed in this environment (pip install -e '.[test]'): {version.stderr}"
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                          *linted_paths()], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, "ruff check found violations (ruff check --fix repairs the [*] ones):\n" + (
        out.stdout[-8000:] + out.stderr[-2000:])

