"""A flow typed with the role views (hfrt.wire.role_views) has its mistakes found by the type
checker: a misspelled endpoint, a misspelled keyword, a keyword of the wrong type. The same
mistakes in an untyped flow are still refused at run time, by the role group, before anything is
sent (the check against the endpoint table the daemons sent in hello)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hfrt.control.daemons import DaemonInfo
from hfrt.control.group import RoleGroup
from hfrt.control.typed_roles import typed
from hfrt.protocols import BatchHandle
from hfrt.wire.endpoints import endpoint_table
from hfrt.wire.errors import BadArguments, UnknownEndpoint
from hfrt.wire.role_views import Actor, Reward

ROOT = Path(__file__).resolve().parents[2]

STEP = """
from hfrt.flows.timing import Stage, StageTimer
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reward


async def step(prompts: BatchHandle, *, actor: Actor, reward: Reward) -> None:
    t = StageTimer()
    rollout = await t.one(Stage.GENERATE, actor.generate(prompts, n=4, {max_new_tokens}=8))
    scores = await reward.{score}(rollout)
    adv = await actor.compute_advantages(rollout, scores, estimator="grpo", norm_adv_by_std=False)
    await actor.update(rollout, adv, ppo_epochs={epochs}, clip_ratio_high=0.28)
    await actor.generate.with_timeout(5.0).call_one(0, prompts, temperature=0.0)
"""
RIGHT = {"max_new_tokens": "max_new_tokens", "score": "score", "epochs": "2"}
WRONG = {"max_new_tokens": "max_new_token", "score": "scroe", "epochs": "'2'"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_type_checker_finds_a_typed_flows_mistakes(tmp_path: Path) -> None:
    (tmp_path / "right_flow.py").write_text(STEP.format(**RIGHT))
    (tmp_path / "wrong_flow.py").write_text(STEP.format(**WRONG))
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-pretty", str(tmp_path / "right_flow.py"), str(tmp_path / "wrong_flow.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=590)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert all("wrong_flow.py" in line for line in errors), errors  # the right flow type-checks
    text = "\n".join(errors)
    assert 'Unexpected keyword argument "max_new_token"' in text and 'did you mean "max_new_tokens"?' in text, text
    assert '"Reward" has no attribute "scroe"; maybe "score"?' in text, text
    assert 'Argument "ppo_epochs" to "__call__" of "Endpoint" has incompatible type "str"; expected "int"' in text, text
    assert len(errors) == 3, text


class Recording:
    """Stands in for the controller: records what a role group sends."""

    recovery = None

    def __init__(self) -> None:
        self.sent: list[tuple[str, float | None]] = []

    def submit(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
               timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]:
        self.sent.append((endpoint, timeout_s))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(BatchHandle.inline({"x": [1]}))
        return future

    def submit_all(self, infos: list[DaemonInfo], endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                   timeout_s: float | None = None) -> asyncio.Future[Any]:
        return self.submit_each([(info, args, kwargs) for info in infos], endpoint, timeout_s=timeout_s)

    def submit_each(self, parts: list[tuple[DaemonInfo, list[Any], dict[str, Any]]], endpoint: str, *,
                    timeout_s: float | None = None, combine: Any = list) -> asyncio.Future[Any]:
        self.sent += [(endpoint, timeout_s) for _ in parts]
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(combine([BatchHandle.inline({"x": [1]}) for _ in parts]))
        return future


def group(impl: str, role: str) -> tuple[RoleGroup, Recording]:
    from hfrt.roles import resolve_impl

    table = {name: spec.describe() for name, (spec, _) in endpoint_table(resolve_impl(impl)).items()}
    info = DaemonInfo(f"{role}:0", role, 0, 1, 0, 1, 100, "h", impl, table, 0.0)
    caller = Recording()
    return RoleGroup(caller, role, [info]), caller


async def test_an_untyped_flows_same_mistakes_are_refused_before_sending() -> None:
    actor, sent = group("actor", "actor")
    reward, _ = group("reward", "reward")
    prompts = BatchHandle.inline({"prompt": ["1+1="]})
    with pytest.raises(BadArguments, match=r"actor\.generate got an unexpected keyword argument 'max_new_token' — did you mean 'max_new_tokens'"):
        actor.generate(prompts, n=4, max_new_token=8)
    with pytest.raises(UnknownEndpoint, match=r"role 'reward' has no endpoint 'scroe' — did you mean 'score'"):
        reward.scroe(prompts)
    assert sent.sent == []
    await actor.generate(prompts, n=4, max_new_tokens=8)
    assert sent.sent == [("generate", None)]  # no timeout of its own: the controller's default applies


async def test_a_typed_group_is_the_group_with_its_timeouts() -> None:
    actor_group, sent = group("actor", "actor")
    actor = typed(actor_group, Actor)
    assert actor is actor_group  # the same object: the runtime checks stay
    prompts = BatchHandle.inline({"prompt": ["1+1="]})
    await actor.generate.with_timeout(7.5)(prompts, n=2)
    await actor.weight_version.with_timeout(2.0).call_one(0)
    await actor.hybrid_phase()
    assert sent.sent == [("generate", 7.5), ("weight_version", 2.0), ("hybrid_phase", None)]
    with pytest.raises(BadArguments, match="did you mean 'max_new_tokens'"):
        actor.generate.with_timeout(1.0)(prompts, max_new_token=3)


def test_a_view_of_another_role_is_refused_naming_what_is_missing() -> None:
    reward_group, _ = group("reward", "reward")
    with pytest.raises(UnknownEndpoint, match=r"role 'reward' lacks endpoint\(s\) .*generate.* that the view Actor declares"):
        typed(reward_group, Actor)
    assert typed(reward_group, Reward) is reward_group
