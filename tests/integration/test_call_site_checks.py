"""With real daemons: a misspelled endpoint or keyword, too many or missing arguments are refused
in the controller at the call site, with a "did you mean", and nothing reaches the daemon. The
check logic on its own: tests/control/test_call_check.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hfrt import BadArguments, UnknownEndpoint
from tests.support import echo_specs, local_cluster

pytestmark = pytest.mark.timeout(240)


async def test_a_misspelled_keyword_never_reaches_the_echo_daemon() -> None:
    async with local_cluster(echo_specs(2)) as (ctl, _):
        echo = await ctl.role("echo")
        await echo.ping()
        sent, trace = ctl.stats()["calls_sent"], ctl.record_calls()
        with pytest.raises(BadArguments, match=r"^echo\.sleep got an unexpected keyword argument 'tagg' — did you mean 'tag'\? Accepted: seconds, tag$"):
            echo.sleep.call_one(0, 0.01, tagg="first")
        with pytest.raises(BadArguments, match=r"^echo\.sleep\(seconds, tag=…\) takes 2 positional arguments but 3 were given$"):
            echo.sleep(0.01, "second", "extra")
        with pytest.raises(BadArguments, match=r"^echo\.record\(tag\) is missing required argument\(s\) 'tag'$"):
            echo.record.broadcast()
        with pytest.raises(UnknownEndpoint, match=r"^role 'echo' has no endpoint 'slep' — did you mean 'sleep'\? It has: .*ping"):
            echo.slep(0.01)
        assert ctl.stats()["calls_sent"] == sent and not trace.spans  # nothing went out ...
        assert await echo.history() == [[], []]  # ... and neither daemon received anything
        assert await echo.sleep.call_one(0, 0.01, tag="right") == 0.01  # the right spelling goes through
        assert await echo.history.call_one(0) == [["start", "right"], ["end", "right"]]


FLOW = '''
ROLES = {"actor": {"impl": "actor", "options": {"model": "tiny"}}}


async def flow(ctl, config):
    actor = await ctl.role("actor")
    state = await actor.advantage_state()
    advantages = actor.compute_advantages(state, estimator="grpo", norm_adv_by_stdd=True)  # norm_adv_by_std
    return {"advantages": await advantages}
'''


@pytest.mark.slow
def test_a_flow_misspelling_an_advantage_option_fails_at_the_call_site(tmp_path: Path) -> None:
    """compute_advantages takes its options as **params; the actor declares their names, so a
    misspelled one fails in the controller, naming the right one, and the actor never sees it."""
    (tmp_path / "flow.py").write_text(textwrap.dedent(FLOW))
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", str(tmp_path / "flow.py"), "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=220,
    )
    assert out.returncode != 0, out.stdout
    assert ("actor.compute_advantages got an unexpected keyword argument 'norm_adv_by_stdd' — "
            "did you mean 'norm_adv_by_std'?") in out.stderr, out.stderr[-3000:]
    assert "remote traceback" not in out.stderr and "RemoteError" not in out.stderr
    events = json.loads((run_dir / "trace.json").read_text())
    calls = [e["name"] for e in events]
    assert "advantage_state" in calls and "compute_advantages" not in calls, calls
