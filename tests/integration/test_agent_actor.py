"""The agent loop on the actor's own generation engine (colocated, no rollout role), real daemons
on the tiny preset: the trained tokens are exactly the sampled ones and tool output is masked; the
actor stays in its generation phase across a round's turns (one weight push per round, not one
per turn) and goes back to training for every training-side endpoint; after an update the next
round samples with the new weights (version up, log-probs changed); turns at a 3D layout (trained
tp=2, generating at tp 2 or 1); and `hfrt controller --flow agent_calc --set agent_on=actor`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.flows.agent.loop import AgentConfig, Conversation, Trajectory, assemble, run_agents
from hfrt.flows.config import CALL_TIMEOUT_S

TOOL_TEXT = "[42]"
TOOL_IDS = [ord(c) - 30 for c in TOOL_TEXT]  # the tiny preset's byte vocabulary
PROMPTS = ("1+1=", "2+12=", "0+1=", "3+4=")
ACTOR = {"model": "tiny", "engine": {"micro_batch_size": 32, "optim": {"lr": 0.05}}}
REWARD = {"kind": "function", "function": "hfrt.flows.agent.loop:agent_reward", "row_fields": ["agent_reward"]}


async def two_turns(conv: Conversation, sample: dict[str, Any]) -> float:
    first = await conv.generate(max_new_tokens=4)
    conv.add(TOOL_TEXT)
    second = await conv.generate(max_new_tokens=3)
    sample["turns"] = [first.ids, second.ids, first.log_probs, second.log_probs]
    return float(sample["score"])


def check_trajectories(trajectories: list[Trajectory], version: int) -> None:
    """Token-in/token-out: the response is the first turn's sampled ids, the tool output, the
    second turn's; only sampled tokens are trained (mask 1) and carry the sampler's log-probs."""
    for tr in trajectories:
        first, second, lp1, lp2 = tr.sample["turns"]
        assert not tr.error and tr.turns == 2, tr.error
        assert tr.prompt_ids == [ord(c) - 30 for c in tr.sample["prompt"]]
        assert tr.response_ids == first + TOOL_IDS + second
        assert tr.gen_mask == [1] * len(first) + [0] * len(TOOL_IDS) + [1] * len(second)
        assert tr.log_probs == lp1 + [0.0] * len(TOOL_IDS) + lp2
        assert tr.weight_versions == [version, version]


async def check_batch(ctl: Any, actor: Any, handle: Any, trajectories: list[Trajectory]) -> None:
    """The assembled batch holds exactly the trajectories' tokens, tool output attended but masked,
    and the actor's training-side log-probs of it are the sampler's."""
    batch = await ctl.fetch(handle)
    width = batch["prompts"].shape[1]
    for row, tr in enumerate(trajectories):
        n = len(tr.response_ids)
        assert batch["responses"][row, :n].tolist() == tr.response_ids
        assert batch["response_mask"][row, :n].tolist() == tr.gen_mask and batch["response_mask"][row, n:].sum() == 0
        assert batch["attention_mask"][row, width:width + n].tolist() == [1] * n
        assert batch["rollout_log_probs"][row, :n].tolist() == pytest.approx(tr.log_probs)
    trained = await ctl.fetch(await actor.compute_log_prob(handle, timeout_s=CALL_TIMEOUT_S))
    mask = batch["response_mask"].bool()
    assert trained["old_log_probs"][mask].tolist() == pytest.approx(batch["rollout_log_probs"][mask].tolist(), abs=2e-4)


def test_every_actor_endpoint_declares_its_phase() -> None:
    """An endpoint every rank receives either returns to the training phase first, stays on the
    generation side, or is declared phase-free; RANK0 endpoints never change phase (a phase change
    can be collective). A new training-side endpoint that forgets its phase fails here."""
    from hfrt.roles.actor import PHASE_ATTR, ActorDaemon
    from hfrt.wire.endpoints import Dispatch, endpoint_table

    table = endpoint_table(ActorDaemon)
    for name, (spec, fn) in table.items():
        trains = bool(getattr(fn, PHASE_ATTR, False))
        if spec.dispatch is Dispatch.RANK0:
            assert not trains, name
        else:
            declared = trains + (name in ActorDaemon.GENERATION_SIDE) + (name in ActorDaemon.PHASE_FREE)
            assert declared == 1, f"actor endpoint {name!r}: {declared} phase declarations"
    for name in ("update", "compute_log_prob", "save", "load", "export_hf", "publish_weights"):
        assert getattr(table[name][1], PHASE_ATTR, False), name
    assert table["generate_turn"][0].dispatch is Dispatch.SPLIT_GENERATION


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_turns_on_the_actor_push_once_per_round_and_the_update_shows_in_the_next() -> None:
    from tests.support import local_cluster

    specs = [DaemonSpec("actor", impl="actor", options=ACTOR), DaemonSpec("reward", impl="reward", options=REWARD)]
    async with local_cluster(specs) as (ctl, _):
        actor, reward = await ctl.role("actor", timeout_s=60), await ctl.role("reward", timeout_s=60)
        samples = [{"prompt": p, "ground_truth": 0, "uid": str(i // 2), "score": float(i % 2)} for i, p in enumerate(PROMPTS)]
        [state] = await actor.hybrid_phase()
        assert state == {"phase": "train", "to_generate": 0, "to_train": 0, "weight_version": 0}

        before = await run_agents(actor, two_turns, [dict(s) for s in samples], AgentConfig(seed=7))
        check_trajectories(before, version=0)
        [state] = await actor.hybrid_phase()  # 2 turns per sample, 1 push: the phase held across turns
        assert (state["phase"], state["to_generate"], state["to_train"]) == ("generate", 1, 0), state
        handle = await assemble(actor, before, carry=("prompt", "ground_truth", "uid"))
        assert (await actor.hybrid_phase())[0]["phase"] == "generate"  # assembling needs no training
        await check_batch(ctl, actor, handle, before)
        [state] = await actor.hybrid_phase()  # compute_log_prob went back to training first
        assert (state["phase"], state["to_generate"], state["to_train"]) == ("train", 1, 1), state

        scores = await reward.score(handle, timeout_s=CALL_TIMEOUT_S)
        adv = await actor.compute_advantages(handle, scores, estimator="grpo", timeout_s=CALL_TIMEOUT_S)
        [metrics] = await actor.update(handle, adv, timeout_s=CALL_TIMEOUT_S)
        assert metrics["actor/optimizer_steps"] == 1
        assert await actor.weight_version() == [1]

        # the same prompts and seed: the new weights push once and score the same tokens differently
        after = await run_agents(actor, two_turns, [dict(s) for s in samples], AgentConfig(seed=7))
        check_trajectories(after, version=1)
        [state] = await actor.hybrid_phase()
        assert (state["phase"], state["to_generate"], state["weight_version"]) == ("generate", 2, 1), state
        first_lp = [tr.sample["turns"][2][0] for tr in before]
        again_lp = [tr.sample["turns"][2][0] for tr in after]
        assert all(abs(a - b) > 1e-6 for a, b in zip(first_lp, again_lp, strict=True)), (first_lp, again_lp)
        await check_batch(ctl, actor, await assemble(actor, after), after)  # the new weights on both sides


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp_g", [2, 1], ids=["t2-gen-t2", "t2-gen-t1"])
async def test_turns_on_a_tensor_parallel_actor(tp_g: int) -> None:
    """Trained at tp=2 on 2 ranks, generating at tp_g: at tp_g=2 both ranks are one generation
    group and must draw the same tokens (no seed given: they agree on one); at tp_g=1 each rank is
    a generation dp group of its own and gets its own rows (SPLIT_GENERATION), or none."""
    from hfrt.session import free_tcp_address
    from tests.support import local_cluster

    options = {**ACTOR, "dist_master": free_tcp_address().removeprefix("tcp://"),
               "parallel": {"tp": 2, "pp": 1}, "generation": {"parallel": {"tp": tp_g, "pp": 1}}}
    async with local_cluster([DaemonSpec("actor", r, 2, impl="actor", options=options) for r in range(2)]) as (ctl, _):
        actor = await ctl.role("actor", timeout_s=90)
        samples = [{"prompt": p, "score": 0.0} for p in PROMPTS[:3]]
        out = await run_agents(actor, two_turns, samples, AgentConfig(temperature=1.0))
        check_trajectories(out, version=0)
        states = await actor.hybrid_phase()
        assert [(s["phase"], s["to_generate"]) for s in states] == [("generate", 1)] * 2, states
        handle = await assemble(actor, out)
        await check_batch(ctl, actor, handle, out)  # a rank that drew other tokens would break this
        assert [s["phase"] for s in await actor.hybrid_phase()] == ["train", "train"]
        # one conversation: at tp_g=1 rank 1's generation group gets no rows, and still takes part
        # in the (collective) transition, so rank 0's does not hang
        single = await run_agents(actor, two_turns, [{"prompt": "5+5=", "score": 0.0}], AgentConfig(seed=1))
        check_trajectories(single, version=0)
        assert [(s["phase"], s["to_generate"]) for s in await actor.hybrid_phase()] == [("generate", 2)] * 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agent_calc_on_the_actor_runs_from_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hfrt", "controller", "--flow", "agent_calc", "--run-dir", str(run_dir),
           "--set", "agent_on=actor", "--set", "steps=3", "--set", "progress=off", "--set", "export_hf=false",
           "--set", "prompts_per_step=2", "--set", "n=4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert sorted(config["roles"]) == ["actor", "reference", "reward"]  # no rollout daemon was launched
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for step, r in enumerate(records):
        assert r["agent/error_rate"] == 0.0 and r["agent/turns_mean"] >= 1.0 and 0.0 <= r["reward/mean"] <= 1.0
        assert r["agent/weight_pushes"] == 1.0 and r["agent/weight_version"] == step, r  # one push per step's turns
        assert r["controller_bulk_bytes"] == 0 and "timing/sync_s" not in r
