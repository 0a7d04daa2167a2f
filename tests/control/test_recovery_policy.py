"""`--set recovery=...` and its limits are read and checked before anything starts (pure logic)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hfrt.control.recovery import STATELESS, RecoveryPolicy
from hfrt.flows import Flow
from hfrt.flows.ppo_family import PPOConfig
from hfrt.session import Attach, run_flow


def test_recovery_is_off_unless_asked_and_on_reads_its_limits() -> None:
    assert not RecoveryPolicy.from_config({}).enabled
    policy = RecoveryPolicy.from_config({"recovery": "on", "recovery_max_restarts": 5, "recovery_window_s": 60})
    assert policy.enabled and policy.max_restarts == 5 and policy.window_s == 60.0
    assert policy.roles == STATELESS and "actor" in policy.stateful


@pytest.mark.parametrize(("key", "value", "says"), [
    ("recovery", "maybe", "config recovery='maybe': use on or off"),
    ("recovery_max_restarts", -1, "config recovery_max_restarts=-1"),
    ("recovery_window_s", 0, "config recovery_window_s=0"),
])
def test_a_bad_recovery_setting_is_refused_naming_it(key: str, value: object, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        RecoveryPolicy.from_config({"recovery": "on", key: value})
    with pytest.raises(ValueError, match=key):
        PPOConfig.read({key: value})


def test_flows_accept_the_recovery_keys() -> None:
    cfg = PPOConfig.read({"recovery": "on", "recovery_max_restarts": 2})
    assert cfg.recovery == "on" and cfg.recovery_max_restarts == 2


def test_recovery_with_attached_daemons_is_refused_before_anything_starts(tmp_path: Path) -> None:
    attach = Attach("tcp://127.0.0.1:1", str(tmp_path / "key"), {"reward": 1})
    with pytest.raises(ValueError, match="only daemons this controller starts can be relaunched"):
        asyncio.run(run_flow(Flow("ping", noop), run_dir=tmp_path / "run", config={"recovery": "on"}, attach=attach))
    assert not (tmp_path / "run").exists()


async def noop(ctl: object, config: object) -> None:
    return None
