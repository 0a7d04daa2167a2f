"""Layer boundaries: the controller side never imports torch; installing adds no generic top-level modules."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_controller_side_does_not_import_torch() -> None:
    code = (
        "import sys, hfrt, hfrt.control.controller, hfrt.control.group, hfrt.session, hfrt.cli, hfrt.flows, hfrt.flows.recipes.ping, "
        "hfrt.protocols, hfrt.deploy, hfrt.serve.server, hfrt.serve.app\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def imported_top_levels(folder: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = {node.module.split(".")[0]}
                if node.module == "hfrt.protocols" or node.module.startswith("hfrt.protocols."):
                    names = set()  # the package's own modules
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(path.name)
    return found


def test_protocols_import_only_stdlib_and_msgpack() -> None:
    imports = imported_top_levels(ROOT / "protocols")
    extra = set(imports) - set(sys.stdlib_module_names) - {"msgpack", "__future__"}
    assert not extra, {name: imports[name] for name in extra}


@pytest.mark.slow
def test_wheel_maps_folders_under_the_hfrt_namespace(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("hfrt-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"hfrt"}, tops
    for sub in ("protocols", "roles", "deploy", "bench"):
        assert f"hfrt/{sub}/__init__.py" in names
