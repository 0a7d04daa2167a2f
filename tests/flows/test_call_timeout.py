"""One default call timeout: the controller a run's session builds carries the flows' CALL_TIMEOUT_S,
so the built-in flows' calls give none (a call that needs another deadline uses
`endpoint.with_timeout(s)`, as the ping flow does). docs/flows.md states the 300 s. No daemon is started."""

from __future__ import annotations

import ast
from pathlib import Path

from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.session import Attach, Session

FLOWS = Path(__file__).resolve().parents[2] / "hfrt" / "flows"
#: the modules whose endpoint calls rely on the controller's default (the trainer's own parts are
#: handed a timeout by the trainer, which is not among them)
STEP_CODE = sorted([*FLOWS.glob("recipes/*.py"), *FLOWS.glob("agent/*.py"), *FLOWS.glob("*_family.py"),
                    FLOWS / "pipeline.py", FLOWS / "async_steps.py", FLOWS / "streaming.py"])


def test_a_runs_controller_carries_the_flows_default(tmp_path: Path) -> None:
    local = Session.local({"echo": {"impl": "echo"}}, run_dir=tmp_path / "local")
    assert local.controller.default_timeout_s == CALL_TIMEOUT_S == 300.0
    attach = Attach("tcp://127.0.0.1:5555", str(tmp_path / "local" / "cluster.key"), {"echo": 1})
    assert Session.attached(attach, run_dir=tmp_path / "attached").controller.default_timeout_s == CALL_TIMEOUT_S


def passes_the_default(source: str) -> list[int]:
    """Lines where `timeout_s` is given CALL_TIMEOUT_S, by keyword or in a dict of keywords."""
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs: list[tuple[str | None, ast.expr]] = []
        if isinstance(node, ast.keyword):
            pairs = [(node.arg, node.value)]
        elif isinstance(node, ast.Dict):
            pairs = [(k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None, v)
                     for k, v in zip(node.keys, node.values, strict=True) if k is not None]
        found += [value.lineno for key, value in pairs
                  if key == "timeout_s" and isinstance(value, ast.Name) and value.id == "CALL_TIMEOUT_S"]
    return found


def test_the_built_in_flows_calls_give_no_timeout_of_their_own() -> None:
    assert len(STEP_CODE) > 15
    passed = [f"{path.relative_to(FLOWS)}:{line}" for path in STEP_CODE for line in passes_the_default(path.read_text())]
    assert passed == []


def test_the_scan_finds_a_passed_default() -> None:
    source = "kw = {'timeout_s': CALL_TIMEOUT_S}\nactor.update(batch, timeout_s=CALL_TIMEOUT_S)\nactor.update(batch, timeout_s=5)\n"
    assert passes_the_default(source) == [1, 2]
