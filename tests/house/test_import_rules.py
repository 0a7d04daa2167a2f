"""The layers' import rules, read from the source with ast (module-level, TYPE_CHECKING and lazy
imports alike): no import circle anywhere, and each folder imports only what its __init__ says."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: installed package name → source folder (pyproject's package-dir)
FOLDERS = {"hfrt": "hfrt", "hfrt.roles": "roles", "hfrt.protocols": "protocols", "hfrt.deploy": "deploy", "hfrt.bench": "bench"}


def module_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


FILES = module_files()


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def imports_of(name: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, lazy) for every import in the file, resolved to a known module
    where one matches (`from pkg import sub` names the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = parsed(path)
    top_level = {id(n) for n in tree.body}
    guarded = {id(n) for node in tree.body if isinstance(node, ast.If) for n in ast.walk(node)}
    for node in ast.walk(tree):
        lazy = id(node) not in top_level and id(node) not in guarded
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in FILES else base), node.lineno, lazy


def known(target: str) -> str | None:
    while target and target not in FILES:
        target = target.rpartition(".")[0]
    return target or None


@functools.cache
def is_face(name: str) -> bool:
    """A package __init__ that only imports and re-exports (defines nothing)."""
    path = FILES[name]
    body = parsed(path).body
    return path.name == "__init__.py" and not any(isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef) for n in body)


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in FILES}
    for name, path in FILES.items():
        for target, _, _ in imports_of(name, path):
            found = known(target)
            if found and found != name and not is_face(found):
                edges[name].add(found)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: folder → (module prefixes it must not import, files allowed a lazy import of one, with why)
RULES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "hfrt.wire": (("hfrt.control", "hfrt.daemon", "hfrt.flows", "hfrt.serve", "hfrt.session", "hfrt.roles", "hfrt.deploy", "torch"), {}),
    "hfrt.protocols": (("hfrt.wire", "hfrt.control", "hfrt.daemon", "hfrt.flows", "hfrt.serve", "hfrt.roles", "hfrt.deploy", "torch"), {}),
    "hfrt.control": (("hfrt.daemon", "hfrt.flows", "hfrt.serve", "hfrt.session", "hfrt.roles", "hfrt.deploy", "torch"),
                     {"hfrt.control.fetch": "Controller.fetch rebuilds tensors on purpose, importing torch only then"}),
    "hfrt.daemon": (("hfrt.control", "hfrt.flows", "hfrt.serve", "hfrt.session", "hfrt.roles", "hfrt.deploy"), {}),
    "hfrt.flows": (("hfrt.roles", "hfrt.daemon", "hfrt.session", "hfrt.deploy", "torch"), {}),
    "hfrt.serve": (("hfrt.flows", "hfrt.roles", "hfrt.daemon", "hfrt.session", "hfrt.deploy", "torch"), {}),
    "hfrt.roles": (("hfrt.control", "hfrt.flows", "hfrt.serve", "hfrt.session", "hfrt.deploy", "hfrt.bench"), {}),
    "hfrt.deploy": (("hfrt.control", "hfrt.daemon", "hfrt.session", "hfrt.roles.", "torch"), {}),
}


def offences(folder: str) -> list[str]:
    banned, allowed_lazy = RULES[folder]
    found = []
    for name, path in FILES.items():
        if name != folder and not name.startswith(folder + "."):
            continue
        for target, line, lazy in imports_of(name, path):
            if any(target == b.rstrip(".") and not b.endswith(".") or target.startswith(b if b.endswith(".") else b + ".")
                   for b in banned):
                if lazy and name in allowed_lazy:
                    continue
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return found


@pytest.mark.parametrize("folder", sorted(RULES))
def test_folder_imports_only_what_its_layer_may(folder: str) -> None:
    assert offences(folder) == []


def test_recipes_import_no_sibling_recipe() -> None:
    recipes = {m for m in FILES if m.startswith("hfrt.flows.recipes.")}
    bad = [f"{name} imports {target}" for name in recipes for target, _, _ in imports_of(name, FILES[name])
           if known(target) in recipes and known(target) != name]
    assert bad == []


def test_every_folder_says_what_it_owns_and_may_import() -> None:
    silent = [str(p.relative_to(ROOT)) for n, p in FILES.items() if p.name == "__init__.py" and not ast.get_docstring(parsed(p))]
    assert silent == []
