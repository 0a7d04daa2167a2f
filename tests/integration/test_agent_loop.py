"""Multi-turn agent rollouts on real daemons (tiny preset): token-in/token-out turns on the rollout
role, the trained tokens exactly the sampled ones (the actor's log-probs of the assembled batch
match the sampler's), tool output masked out of training, hanging and crashing tools ending only
their own sample, bad input refused with the daemon still serving, and the agent_calc flow."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.flows.agent.loop import AgentConfig, Conversation, assemble, run_agents
from hfrt.flows.batches import prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.wire.errors import RemoteError

TOOL_TEXT = "[42]"


def specs(actor: bool = False) -> list[DaemonSpec]:
    rollout = DaemonSpec("rollout", impl="rollout", options={"model": "tiny", "seed": 0})
    train = DaemonSpec("actor", impl="actor", options={"model": "tiny", "engine": {"micro_batch_size": 32}})
    return [rollout, train] if actor else [rollout]


async def two_turns(conv: Conversation, sample: dict[str, Any]) -> float:
    first = await conv.generate(max_new_tokens=4)
    conv.add(TOOL_TEXT)
    second = await conv.generate(max_new_tokens=3)
    sample["turns"] = [first.ids, second.ids, first.log_probs, second.log_probs]
    return 0.5


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_trained_tokens_are_the_sampled_ones_and_tool_output_is_masked() -> None:
    from tests.support import local_cluster

    async with local_cluster(specs(actor=True)) as (ctl, _):
        actor, rollout = await ctl.role("actor", timeout_s=60), await ctl.role("rollout", timeout_s=60)
        [published] = await actor.publish_weights(0)
        await rollout.load_weights(published, timeout_s=CALL_TIMEOUT_S)
        samples = [{"prompt": p} for p in ("1+1=", "2+12=", "0+1=")]
        trajectories = await run_agents(rollout, two_turns, samples, AgentConfig(seed=7))
        tool_ids = [ord(c) - 30 for c in TOOL_TEXT]  # the tiny preset's byte vocabulary
        for tr in trajectories:
            first, second, lp1, lp2 = tr.sample["turns"]
            assert not tr.error and tr.turns == 2 and tr.reward == 0.5
            assert tr.prompt_ids == [ord(c) - 30 for c in tr.sample["prompt"]]
            assert tr.response_ids == first + tool_ids + second
            assert tr.gen_mask == [1] * len(first) + [0] * len(tool_ids) + [1] * len(second)
            assert tr.log_probs == lp1 + [0.0] * len(tool_ids) + lp2
            assert tr.weight_versions == [0, 0]
        handle = await assemble(rollout, trajectories, carry=("prompt",))
        batch = await ctl.fetch(handle)
        width = batch["prompts"].shape[1]
        for row, tr in enumerate(trajectories):
            n = len(tr.response_ids)
            assert batch["responses"][row, :n].tolist() == tr.response_ids
            assert batch["response_mask"][row, :n].tolist() == tr.gen_mask and batch["response_mask"][row, n:].sum() == 0
            assert batch["attention_mask"][row, width:width + n].tolist() == [1] * n  # tool output is context
            assert batch["prompts"][row, width - len(tr.prompt_ids):].tolist() == tr.prompt_ids
            assert batch["rollout_log_probs"][row, :n].tolist() == pytest.approx(tr.log_probs)
        assert batch.non_tensor["prompt"] == [s["prompt"] for s in samples]
        assert all(TOOL_TEXT in text for text in batch.non_tensor["response"])
        # the trainer's log-probs of the assembled tokens are the sampler's (same weights, same tokens, same positions)
        trained = await ctl.fetch(await actor.compute_log_prob(handle, timeout_s=CALL_TIMEOUT_S))
        column = trained["old_log_probs"] if "old_log_probs" in trained else trained[trained.keys()[0]]
        mask = batch["response_mask"].bool()
        assert column[mask].tolist() == pytest.approx(batch["rollout_log_probs"][mask].tolist(), abs=2e-4)


def hangs(_: str) -> str:
    time.sleep(30)
    return "never"


def crashes(_: str) -> str:
    raise ZeroDivisionError("the calculator divided by zero")


async def faulty(conv: Conversation, sample: dict[str, Any]) -> float:
    await conv.generate(max_new_tokens=2)
    kind = sample["kind"]
    if kind == "hang":
        await conv.tool(hangs, "x", timeout_s=0.5)
    elif kind == "crash":
        await conv.tool(crashes, "x")
    elif kind == "stall":
        await asyncio.sleep(30)
    elif kind == "oom":
        await conv.run_code("x = bytearray(1024 * 2**20)")
    conv.add(str(await conv.tool(len, "abc")))
    await conv.generate(max_new_tokens=2)
    return 1.0


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_hanging_and_crashing_tools_end_their_own_sample_only() -> None:
    from tests.support import local_cluster

    async with local_cluster(specs()) as (ctl, _):
        rollout = await ctl.role("rollout", timeout_s=60)
        kinds = ["ok", "hang", "crash", "oom", "ok"]
        out = await run_agents(rollout, faulty, [{"prompt": "1+1=", "kind": k} for k in kinds], AgentConfig(flush_after_s=0.02))
        # the agent's own code hangs: the sample time limit ends it (its own run: the others get no deadline)
        [stalled] = await run_agents(rollout, faulty, [{"prompt": "1+1=", "kind": "stall"}], AgentConfig(sample_timeout_s=1.0))
        kinds, out = [*kinds, "stall"], [*out, stalled]
        errors = {k: tr.error for k, tr in zip(kinds, out, strict=True)}
        assert errors["hang"] == "tool hangs timed out after 0.5 s"
        assert errors["crash"] == "tool crashes raised ZeroDivisionError: the calculator divided by zero"
        assert errors["stall"] == "the agent ran past sample_timeout_s=1.0"
        assert errors["oom"].startswith("sandboxed code stopped: memory limit (512 MB) exceeded")
        for k, tr in zip(kinds, out, strict=True):
            assert (tr.reward, tr.turns) == ((1.0, 2) if k == "ok" else (0.0, 1)), k
            assert tr.gen_mask[-1] == 1 and (tr.gen_mask.count(0) == 1) == (k == "ok")  # "3" appended
        batch = await ctl.fetch(await assemble(rollout, out))  # failed samples still train (reward 0)
        assert batch.non_tensor["agent_error"] == [errors[k] for k in kinds]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_bad_turn_requests_are_refused_and_the_daemon_serves_on() -> None:
    from tests.support import local_cluster

    async with local_cluster(specs()) as (ctl, _):
        rollout = await ctl.role("rollout", timeout_s=60)
        with pytest.raises(RemoteError, match=r"generate_turn needs non-tensor columns \['append'\]"):
            await rollout.generate_turn(prompts_handle({"context": [[1, 2]]}))
        with pytest.raises(RemoteError, match=r"logit_bias: token id 99999 is outside the vocabulary") as bias:
            await rollout.generate_turn(prompts_handle({"context": [[5]], "append": [[]]}), logit_bias={99999: 1.0})
        assert bias.value.param == "logit_bias"  # the refused option, named in the error record
        # a stop string of several tokens ends the turn at the text level (here: never met, so max_new_tokens does)
        out = await rollout.generate_turn(prompts_handle({"context": [[5]], "append": [[]]}), max_new_tokens=3, stop={"strings": ["</calc>"]})
        assert len(out.shards[0].non_tensor["turn_ids"][0]) <= 3
        with pytest.raises(RemoteError, match="generate_turn row 0: a conversation has no tokens") as empty:
            await rollout.generate_turn(prompts_handle({"context": [[]], "append": [[]]}))
        assert (empty.value.type_name, empty.value.param) == ("InvalidArgument", "prompt")
        with pytest.raises(RemoteError, match="leaves no room in the model's context") as full:
            await rollout.generate_turn(prompts_handle({"context": [[5] * 600], "append": [[]]}), fit_context=True)  # tiny: 512
        assert (full.value.type_name, full.value.param) == ("ContextTooLong", "prompt")
        with pytest.raises(RemoteError, match=r"assemble_trajectories: trajectories \[0\] have no prompt tokens"):
            await rollout.assemble_trajectories(prompts_handle(
                {"prompt_ids": [[]], "response_ids": [[3]], "response_gen_mask": [[1]], "response_log_probs": [[0.0]]}))
        out = await rollout.generate_turn(prompts_handle({"context": [[5, 6]], "append": [["+"]]}), max_new_tokens=3, stop={"strings": [">"]})
        [row] = out.shards[0].non_tensor["appended"]
        assert row == [[ord("+") - 30]] and await rollout.weight_version() == [-1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_agent_calc_flow_runs_from_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hfrt", "controller", "--flow", "agent_calc", "--run-dir", str(run_dir),
           "--set", "steps=2", "--set", "progress=off", "--set", "export_hf=false", "--set", "prompts_per_step=2", "--set", "n=4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["agent/error_rate"] == 0.0 and r["agent/turns_mean"] >= 1.0 and 0.0 <= r["reward/mean"] <= 1.0
        assert r["controller_bulk_bytes"] == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_two_rollout_ranks_share_the_turns_and_assemble_one_fixed_width_batch() -> None:
    from hfrt.session import free_tcp_address
    from tests.support import local_cluster

    group = {"dist_master": free_tcp_address().removeprefix("tcp://")}
    ranks = [DaemonSpec("rollout", r, 2, impl="rollout", options={"model": "tiny", **group}) for r in range(2)]
    async with local_cluster(ranks) as (ctl, _):
        rollout = await ctl.role("rollout", timeout_s=60)
        samples = [{"prompt": p} for p in ("1+1=", "12+12=", "0+0=")]  # 2 rows on rank 0, 1 on rank 1
        out = await run_agents(rollout, two_turns, samples, AgentConfig(seed=3))
        handle = await assemble(rollout, out)
        assert [s.rows for s in handle.shards] == [2, 1]
        batch = await ctl.fetch(handle)  # the shards stack: one prompt width and one response width
        assert batch["prompts"].shape[1] == len("12+12=") and batch["responses"].shape[1] == max(len(t.response_ids) for t in out)
        assert batch["response_mask"].sum().item() == sum(sum(t.gen_mask) for t in out)
