"""No probing of one's own attributes: `getattr(self, "name", default)` and `hasattr(self, "name")`
mean an attribute is sometimes there and sometimes not (made outside `__init__`/setup), which a
reader and a type checker cannot follow. Attributes get a typed default in the class or are made
in `__init__`/setup; getattr stays for duck-typing other objects."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hfrt", "roles", "deploy", "protocols", "bench")
#: (file, attribute) probes kept on purpose, each with its reason
ALLOWED = {
    # a field only the configs of flows that sample groups declare (GRPO's family, distillation)
    ("hfrt/flows/config.py", "n"),
}


def probes(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of each getattr(self, "literal", ...) / hasattr(self, "literal") in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")):
            continue
        if len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if node.func.id == "hasattr" or len(node.args) == 3:
                    found.append((node.lineno, name.value))
    return found


def test_no_class_probes_its_own_attributes() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {attr!r}" for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for line, attr in probes(path) if (str(path.relative_to(ROOT)), attr) not in ALLOWED]
    assert not found, "attributes probed instead of given a default in the class or made in __init__/setup:\n" + "\n".join(found)


def test_the_probe_finder_finds_probes(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('class A:\n    def f(self):\n        return getattr(self, "x", None), hasattr(self, "y"), getattr(self, "z")\n')
    assert probes(sample) == [(3, "x"), (3, "y")]  # getattr without a default is plain access
