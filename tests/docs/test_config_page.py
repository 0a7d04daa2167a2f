"""docs/configuration.md lists every key of every built-in flow as the config dataclasses say now."""

from __future__ import annotations

import dataclasses

from hfrt.flows import BUILTIN, load_flow
from tests.docs.config_page import PAGE, render


def test_committed_page_is_what_the_generator_writes() -> None:
    page = PAGE.read_text()
    assert render(page) == page, (
        "docs/configuration.md differs from the flows' config dataclasses: "
        "run `python -m tests.docs.config_page` and commit the page"
    )


def test_every_key_of_every_flow_is_on_the_page() -> None:
    page = PAGE.read_text()
    for name in BUILTIN:
        cls = load_flow(name).config_cls
        assert f"### `{name}`" in page
        for f in dataclasses.fields(cls) if cls is not None else ():
            assert f"| `{f.name}` |" in page, f"{name}: key {f.name} is not on the page"


def test_generator_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, tests.docs.config_page as p; p.generate(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=PAGE.parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
