"""Every code block of README.md and docs/*.md is run or checked, or skipped with its reason printed.

How a block is used is said by the HTML comment above it (tests/docs/snippets.py lists them).
Runnable blocks of one page share a scratch folder, in page order, so a page's `module` block is
importable by its flow block and a command may use what the one before it wrote.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.docs.snippets import ROOT, Block, all_blocks, blocks, commands

BLOCKS = all_blocks()
BIN = str(Path(sys.executable).parent)
#: how long one command of a runnable block may take (a PPO run of 2 steps takes ~30 s on 2 loaded cores)
COMMAND_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One scratch folder per page: its `module` blocks written, `deploy/` and `bench/` linked."""
    folders: dict[str, Path] = {}

    def folder(page: str) -> Path:
        if page not in folders:
            path = tmp_path_factory.mktemp(Path(page).stem)
            for name in ("deploy", "bench"):
                (path / name).symlink_to(ROOT / name)
            for b in blocks(ROOT / page):
                if b.directive == "run" and b.arg.startswith("module "):
                    (path / b.arg.split()[1]).write_text(b.text)
            folders[page] = path
        return folders[page]

    return folder


def env() -> dict[str, str]:
    out = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return out


def run(cmd: list[str] | str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          shell=isinstance(cmd, str), executable="/bin/bash" if isinstance(cmd, str) else None)


def check_summary(out: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    """A controller run ended well: exit 0 and a JSON summary with no bulk bytes through the controller."""
    assert out.returncode == 0, f"{what} exited {out.returncode}:\n{out.stderr[-4000:]}"
    start = 0 if out.stdout.startswith("{") else out.stdout.rfind("\n{") + 1  # a flow may print before it
    summary = json.loads(out.stdout[start:])
    assert isinstance(summary, dict) and summary, f"{what}: no summary on stdout"
    stats = summary.get("stats", summary)
    assert stats.get("controller_bulk_bytes", 0) == 0, f"{what}: tensor bytes went through the controller"
    return summary


def runnable(b: Block) -> bool:
    return b.directive in ("", "run") and b.lang in ("python", "bash")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "bash")], ids=lambda b: b.id)
def test_block_runs(block: Block, scratch: Any) -> None:
    if block.directive == "not run":
        pytest.skip(f"{block.id}: {block.arg}")
    if block.directive == "tested-by":
        test = ROOT / block.arg
        assert test.is_file(), f"{block.id}: its test {block.arg} does not exist"
        pytest.skip(f"{block.id}: run by {block.arg}")
    assert runnable(block), f"{block.id}: unknown directive {block.directive!r} for a {block.lang} block"
    cwd = scratch(block.page)
    if block.lang == "bash":
        for command in commands(block.text):
            out = run(command, cwd)
            if re.match(r"hfrt controller\b", command):
                check_summary(out, command)
            else:
                assert out.returncode == 0, f"{command} exited {out.returncode}:\n{out.stderr[-4000:]}"
        return
    if block.arg.startswith("module "):
        name = block.arg.split()[1]
        out = run([sys.executable, "-c", f"import {Path(name).stem}"], cwd)
        assert out.returncode == 0, f"{block.id}: {name} does not import:\n{out.stderr[-4000:]}"
        return
    script = cwd / f"block_{block.line}.py"
    script.write_text(block.text)
    if block.arg.startswith("flow"):
        extra = shlex.split(block.arg[len("flow"):])
        cmd = ["hfrt", "controller", "--flow", script.name, "--run-dir", f"run_{block.line}", *extra]
        check_summary(run(cmd, cwd), f"{block.id} ({' '.join(cmd)})")
    else:
        out = run([sys.executable, script.name], cwd)
        assert out.returncode == 0, f"{block.id} exited {out.returncode}:\n{out.stderr[-4000:]}"


def set_values(items: list[str]) -> dict[str, Any]:
    """`--set key=value` items as hfrt reads them: JSON when it parses, dots nest."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        *parents, leaf = key.split(".")
        table = out
        for part in parents:
            table = table.setdefault(part, {})
        table[leaf] = value
    return out


def controller_lines() -> list[tuple[str, str]]:
    return [(b.id, c) for b in BLOCKS if b.lang == "bash" for c in commands(b.text) if c.startswith("hfrt controller")]


@pytest.mark.parametrize(("where", "command"), controller_lines(), ids=lambda v: v if ":" in str(v) else "")
def test_controller_commands_name_real_flows_and_keys(where: str, command: str) -> None:
    """Run or not, every `hfrt controller --flow NAME --set k=v` line names a built-in flow (or a .py
    file) and only keys its Config accepts."""
    from hfrt.flows import BUILTIN, load_flow

    argv = shlex.split(command.split(" #")[0])
    flow = argv[argv.index("--flow") + 1] if "--flow" in argv else ""
    if not flow or flow.endswith(".py"):
        return
    assert flow in BUILTIN, f"{where}: {command}: no built-in flow {flow!r}"
    sets = set_values([argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
    sets.pop("roles", None)
    reader_file = "data" in sets and ":" not in str(sets["data"])  # data files are the reader's own
    try:
        load_flow(flow).check(sets)  # raises ValueError naming an unknown key or a bad value
    except ValueError as exc:  # keys and types are read before the data: only its file may be missing
        if not (reader_file and str(exc).startswith("config data:")):
            raise


def toml_blocks(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == "toml" and b.directive == "checked" and b.arg.startswith(kind)]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "toml"], ids=lambda b: b.id)
def test_toml_block_parses(block: Block) -> None:
    assert tomllib.loads(block.text), f"{block.id}: an empty TOML block"


@pytest.mark.parametrize("block", toml_blocks("run config for "), ids=lambda b: b.id)
def test_run_config_block_is_valid(block: Block, tmp_path: Path) -> None:
    """A run.toml shown in the docs is a valid configuration of its flow, role options included."""
    from hfrt import config as runconfig
    from hfrt.flows import load_flow

    flow = load_flow(block.arg.split()[-1])
    (tmp_path / "run.toml").write_text(block.text)
    rc = runconfig.build(flow.roles, file=tmp_path / "run.toml", sets=["steps=300"])
    assert rc.flow.get("steps") == 300
    # data files are the reader's own; a named source (reasoning_gym:TASK) is checked
    flow.check({k: v for k, v in rc.flow.items() if k not in ("data", "val_data") or ":" in str(v)})
    runconfig.check_role_options(rc.roles)


@pytest.mark.parametrize("block", toml_blocks("cluster spec"), ids=lambda b: b.id)
def test_cluster_spec_block_is_valid(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    from hfrt.deploy import parse_spec, place

    cluster = parse_spec(tomllib.loads(block.text), block.id)
    assert len(place(cluster)) == sum(r.world_size for r in cluster.roles.values())


def test_docs_show_an_ssh_and_a_slurm_spec() -> None:
    from hfrt.deploy import parse_spec

    launchers = {parse_spec(tomllib.loads(b.text), b.id).launcher for b in toml_blocks("cluster spec")}
    assert launchers == {"ssh", "slurm"}


@pytest.mark.parametrize("block", toml_blocks("plan file"), ids=lambda b: b.id)
def test_plan_block_is_valid(block: Block) -> None:
    """A PLAN.toml shown in the docs plans; a model given as a folder path (not here) is left out."""
    from hfrt.deploy.plan.file import parse_plan

    data = tomllib.loads(block.text)
    data["models"] = {k: v for k, v in data.get("models", {}).items() if not (isinstance(v, str) and "/" in v)}
    plan = parse_plan(data, block.id)
    assert plan.flow == data["flow"]


def test_every_block_says_how_it_is_used() -> None:
    """A python or bash block either runs or names why not; no directive is misspelt."""
    for b in BLOCKS:
        assert b.directive in ("", "run", "not run", "tested-by", "checked"), b.id
        if b.directive == "not run":
            assert len(b.arg) > 10, f"{b.id}: say why it is not run"
        if b.directive == "checked":
            assert b.lang == "toml", f"{b.id}: only TOML blocks are checked"


def test_readme_commands_are_what_ci_runs() -> None:
    """The README's two commands, exactly; CI runs the README's test command."""
    readme = [b.text.strip() for b in blocks(ROOT / "README.md") if b.lang == "bash"]
    assert readme[0] == "bash .ci/install && . .venv/bin/activate && hfrt controller --flow ppo"
    assert readme[1] == ". .venv/bin/activate && python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/install" in ci and "python -m pytest -q" in ci


def test_readme_is_an_overview_with_a_docs_map() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", text))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages missing from the README's map: {sorted(pages - linked)}"


def test_links_between_pages_resolve() -> None:
    """Every relative link of README.md and docs/ points to a file that exists (and a heading
    that exists, when it names one)."""
    from tests.docs.snippets import pages

    for page in pages():
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to {target}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), f"{page.name}: link to {target}: no such heading"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_flow_author_examples_import_the_public_api() -> None:
    """Examples import Trainer, FlowConfig, get_roles, StageTimer, step_metrics from `hfrt`."""
    public = ("Trainer", "FlowConfig", "get_roles", "StageTimer", "step_metrics")
    for b in BLOCKS:
        if b.lang != "python":
            continue
        for module, names in re.findall(r"^from (\S+) import (.+)$", b.text, re.M):
            if module != "hfrt":
                bad = [n for n in public if re.search(rf"\b{n}\b", names)]
                assert not bad, f"{b.id}: imports {bad} from {module}; use `from hfrt import ...`"
