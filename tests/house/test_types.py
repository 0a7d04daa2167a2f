"""The type checker runs as part of the suite (STYLE.md: annotate everything, and check it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mypy_passes_on_every_package() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=590)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
