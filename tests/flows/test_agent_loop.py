"""Pure logic of the agent loop (hfrt.flows.agent.loop, agent_calc) against a scripted stand-in for the
rollout role: turn batching, masks and log-probs of a trajectory, limits, errors per sample."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import pytest

from hfrt.flows.agent.loop import AgentConfig, AgentGenerationError, Conversation, run_agents, trajectory_columns
from hfrt.flows.batches import non_tensor
from hfrt.flows.recipes.agent_calc import calc_agent, calculator
from hfrt.protocols import BatchHandle


class ScriptedRollout:
    """generate_turn as the rollout role answers it: ids are character codes; `reply` picks the text."""

    def __init__(self, reply: Callable[[list[int]], str] = lambda ctx: "ab", fail: bool = False) -> None:
        self.reply, self.fail = reply, fail
        self.calls: list[dict[str, Any]] = []

    async def generate_turn(self, handle: BatchHandle, **options: Any) -> BatchHandle:
        self.calls.append(options | {"rows": len(non_tensor(handle, "context"))})
        if self.fail:
            raise RuntimeError("rollout:0 is gone")
        appended, ids, lps, texts = [], [], [], []
        for context, append in zip(non_tensor(handle, "context"), non_tensor(handle, "append"), strict=True):
            pieces = [[ord(c) for c in text] for text in append]
            full = list(context) + [t for p in pieces for t in p]
            text = self.reply(full)[: options["max_new_tokens"]]
            appended.append(pieces)
            ids.append([ord(c) for c in text])
            lps.append([-0.5] * len(text))
            texts.append(text)
        rows = len(ids)
        return BatchHandle.inline({"appended": appended, "turn_ids": ids, "turn_log_probs": lps, "turn_text": texts, "weight_version": [3] * rows})


async def talk(conv: Conversation, sample: dict[str, Any]) -> float:
    await conv.generate()
    if sample.get("slow"):
        await asyncio.sleep(0.3)
    conv.add("[T]")
    await conv.generate()
    return 1.0


async def test_turns_are_batched_and_a_slow_tool_holds_no_one_back() -> None:
    rollout = ScriptedRollout()
    samples = [{"prompt": "p1"}, {"prompt": "p2", "slow": True}, {"prompt": "p3"}]
    out = await run_agents(rollout, talk, samples, AgentConfig(flush_after_s=0.01, seed=10))
    assert [c["rows"] for c in rollout.calls] == [3, 2, 1]  # the slow one's second turn goes alone
    assert [c["seed"] for c in rollout.calls] == [10, 11, 12]
    assert rollout.calls[0]["stop"] == {"strings": []}
    for tr in out:
        assert tr.prompt_ids == [ord(c) for c in tr.sample["prompt"]] and tr.turns == 2 and tr.reward == 1.0
        assert tr.response_ids == [ord(c) for c in "ab[T]ab"]
        assert tr.gen_mask == [1, 1, 0, 0, 0, 1, 1]
        assert tr.log_probs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5, -0.5]
        assert tr.weight_versions == [3, 3]


async def test_limits_and_agent_errors_end_one_sample() -> None:
    async def agent(conv: Conversation, sample: dict[str, Any]) -> float:
        if sample["kind"] == "bad_add":
            conv.add(b"bytes")  # type: ignore[arg-type]
        for _ in range(sample.get("turns", 1)):
            await conv.generate()
        return 0.7

    samples = [{"prompt": "p", "kind": "ok"}, {"prompt": "p", "kind": "bad_add"}, {"prompt": "p", "kind": "long", "turns": 9}]
    cfg = AgentConfig(max_new_tokens=2, max_total_tokens=7, error_reward=-1.0)
    ok, bad, long = await run_agents(ScriptedRollout(), agent, samples, cfg)
    assert (ok.reward, ok.error) == (0.7, "")
    assert bad.reward == -1.0 and bad.error.startswith("TypeError: Conversation.add takes text, not b'bytes'")
    assert long.error == "the conversation reached max_total_tokens=7" and long.reward == -1.0
    assert len(long.prompt_ids) + len(long.response_ids) == 7  # the last turn was cut to the budget
    columns = trajectory_columns([ok, bad, long], carry=("kind",))
    assert columns["kind"] == ["ok", "long"]  # bad failed before its first turn: nothing to train on
    assert columns["agent_error"] == ["", long.error] and columns["weight_version"] == [3, 3]


async def test_a_failed_generation_call_fails_the_run() -> None:
    with pytest.raises(AgentGenerationError, match="generate_turn on the rollout role failed for 2 conversations: rollout:0 is gone"):
        await run_agents(ScriptedRollout(fail=True), talk, [{"prompt": "a"}, {"prompt": "b"}])


def test_calculator() -> None:
    assert calculator(" 12+3*4 ") == 24 and calculator("7-9") == -2
    for bad in ("2**99", "__import__('os')", "1/0", "1.5+1"):
        with pytest.raises(ValueError, match="is not \\+, - or \\* of integers"):
            calculator(bad)


async def test_calc_agent_calls_the_calculator_and_scores_the_answer() -> None:
    script = iter(["<calc>", "2+3</calc>", "5 done", "<calc>", "9*9</calc>", "7"])

    def reply(_: list[int]) -> str:
        return next(script)

    rollout = ScriptedRollout(reply)
    right, wrong = [await run_agents(rollout, calc_agent, [{"prompt": "2+3=", "ground_truth": "5"}], AgentConfig(max_new_tokens=16))
                    for _ in range(2)]
    assert right[0].reward == 1.0 and right[0].sample["tool_calls"] == 1
    text = "".join(chr(t) for t in right[0].response_ids)
    assert text == "<calc>2+3</calc>[5]5 done"
    assert right[0].gen_mask == [1] * len("<calc>2+3</calc>") + [0] * 3 + [1] * len("5 done")
    assert rollout.calls[0]["stop"] == {"strings": [">", "\n"]} and rollout.calls[0]["include_stop_str_in_output"] is True  # the text keeps ">"
    assert wrong[0].reward == 0.0 and "".join(chr(t) for t in wrong[0].response_ids).endswith("[81]7")


def test_the_agent_modules_do_not_import_torch() -> None:
    import subprocess

    code = "import sys, hfrt.flows.agent.loop, hfrt.flows.recipes.agent_calc, hfrt.flows.agent.sandbox; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
