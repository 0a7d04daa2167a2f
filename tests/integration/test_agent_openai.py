"""The agent_openai flow on real daemons (tiny preset): smolagents' ToolCallingAgent drives the policy
through the run's OpenAI-compatible endpoint, each conversation recorded as exact trajectories
(gen_mask 1 on sampled tokens only, their sampler log-probs), scored on its final answer and
trained on by GRPO: two steps whose losses are finite, whose update moves the weights (the second
step samples with weight version 1 and the gradient is non-zero), and whose trajectories are the
ones the endpoint recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hfrt import config as runconfig
from hfrt.bench.recipes import make_calc_data
from hfrt.flows import load_flow
from hfrt.flows.data import read_rows

RECIPE = Path(__file__).resolve().parents[2] / "bench" / "recipes" / "smollm2-calc-openai.toml"


def varied_reward(answer: Any, sample: dict[str, Any]) -> float:
    """A reward a random tiny model's answers vary on (the parity of the answer's length), so GRPO groups have a signal."""
    return float(len(str(answer)) % 2)


def failing_driver(call: Any) -> Any:
    if call.sample["prompt"] == "slow":
        time.sleep(2)
    raise RuntimeError(f"no answer for {call.sample['prompt']} in {call.session}")


@pytest.mark.asyncio
async def test_a_failing_or_slow_driver_ends_only_its_own_conversation() -> None:
    from hfrt.flows.agent.external import DriverCall, episode_metrics, run_external
    from hfrt.serve.server import OpenAIServer

    async with OpenAIServer(object(), model="policy") as server:
        call = DriverCall(server.url, "", "policy", "", {}, max_tokens=8, temperature=1.0, max_steps=1, timeout_s=0.5)
        episodes = await run_external(server, failing_driver, varied_reward, [{"prompt": "1+1"}, {"prompt": "slow"}], call,
                                      tag="t-", threads=2, error_reward=-1.0)
    assert [e.error for e in episodes] == ["RuntimeError: no answer for 1+1 in t-0", "the agent ran past sample_timeout_s=0.5"]
    assert all(e.reward == -1.0 and e.trajectories == [] and e.calls == 0 for e in episodes) and not server.sessions
    assert episode_metrics(episodes)["agent/error_rate"] == 1.0


def test_bad_driver_reward_or_settings_are_refused_naming_the_key() -> None:
    config = load_flow("agent_openai").config_cls
    with pytest.raises(ValueError, match=r"agent_driver='crewai': give module:function or one of smolagents"):
        config.read({"agent_driver": "crewai"})
    with pytest.raises(ValueError, match=r"agent_reward='hfrt.nothing:f': cannot load it"):
        config.read({"agent_reward": "hfrt.nothing:f"})
    with pytest.raises(ValueError, match=r"tool_parser='qwen'"):
        config.read({"tool_parser": "qwen"})
    with pytest.raises(ValueError, match=r"max_staleness=1: agent_openai runs synchronous steps only"):
        config.read({"max_staleness": 1})


def test_recipe_data_and_config_parse_as_an_agent_openai_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # as the recipe's header runs it: the data maker's task style asks the few-shot style's questions, bare
    monkeypatch.chdir(tmp_path)
    make_calc_data.main(["--out", "runs/calc-task", "--style", "task", "--train", "8", "--val", "4"])
    make_calc_data.main(["--out", "runs/calc", "--train", "8", "--val", "4"])
    for name in ("train.jsonl", "val.jsonl"):
        tasks, shots = read_rows(Path("runs/calc-task") / name), read_rows(Path("runs/calc") / name)
        assert [r["prompt"] + "=" for r in tasks] == [r["prompt"].rsplit("\n", 1)[1] for r in shots]
        assert [r["ground_truth"] for r in tasks] == [r["ground_truth"] for r in shots]
    flow = load_flow("agent_openai")
    rc = runconfig.build(flow.roles, file=RECIPE)
    cfg = flow.config_cls.read({**rc.flow, "run_dir": str(tmp_path)})
    assert cfg.agent_driver == "smolagents" and cfg.agent_stop == "}}" and cfg.data == "runs/calc-task/train.jsonl"
    # every role starts from the SFT warm-up's model (bench/recipes/sft_calc_openai.py writes it)
    assert {rc.roles[r]["options"]["model"] for r in ("actor", "reference", "rollout")} == {"runs/calc-openai-sft/hf"}
    from hfrt.roles.models import build_tiny

    model, tokenizer = build_tiny(0)  # stands in for the warm-up's folder: model options are checked against it
    model.save_pretrained("runs/calc-openai-sft/hf")
    tokenizer.save_pretrained("runs/calc-openai-sft/hf")
    runconfig.check_role_options(rc.roles)


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with a 2,048-token context: smolagents' tool schemas and prompts are ~1,000
    byte-level tokens, past the preset's 512."""
    from hfrt.roles.models import build_tiny

    model, tokenizer = build_tiny(0)
    model.config.max_position_embeddings = 2048
    folder = tmp_path_factory.mktemp("tiny2k")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_smolagents_conversations_are_recorded_as_trajectories_and_trained_on_by_grpo(long_tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("smolagents", reason="smolagents is in the `test` extra (pip install smolagents)")
    from tokenizers import Tokenizer

    run_dir = tmp_path / "run"
    sets = ["steps=2", "progress=off", "export_hf=false", "prompts_per_step=2", "n=4", "max_new_tokens=16", "max_total_tokens=1600",
            "max_turns=1", "save_trajectories=true", "agent_reward=tests.integration.test_agent_openai:varied_reward"]
    sets += [f"roles.{role}.options.model={long_tiny}" for role in ("actor", "rollout", "reference")]
    cmd = [sys.executable, "-m", "hfrt", "controller", "--flow", "agent_openai", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["agent/error_rate"] == 0.0 and r["agent/calls_mean"] >= 1.0 and r["controller_bulk_bytes"] == 0
        assert all(abs(r[k]) < 1e3 for k in ("actor/loss", "actor/pg_loss", "actor/kl_loss")), r  # finite (NaN fails too)
    assert records[0]["actor/grad_norm"] > 0.0  # a real gradient: the groups' rewards differ
    decode = Tokenizer.from_file(str(long_tiny / "tokenizer.json")).decode
    for step in (0, 1):
        rows = [json.loads(line) for line in (run_dir / "trajectories" / f"step-{step}.jsonl").read_text().splitlines()]
        assert len({r["session"].split("/")[0] for r in rows}) == 8  # 2 prompts × n=4 conversations, each recorded
        for r in rows:
            # each HTTP call of smolagents (which re-renders its memory) is its own exact trajectory:
            # the prompt as the chat template rendered it, then only sampled tokens (mask 1, their log-probs)
            assert len(r["response_ids"]) == len(r["gen_mask"]) == len(r["log_probs"]) > 0
            # (smolagents forces its calls: sampled under the call's grammar, a token it left no choice has log-prob 0)
            assert r["gen_mask"] == [1] * len(r["response_ids"]) and all(lp <= 0 for lp in r["log_probs"])
            assert r["weight_versions"] == [step]  # step 1 sampled with the weights step 0's update made
            assert r["reward"] == varied_reward(r["answer"], {}) and not r["error"]
            prompt = decode(r["prompt_ids"], skip_special_tokens=False)
            assert "New task:" in prompt and prompt.endswith("<assistant>" if "/" in r["session"] else "<assistant><tool_call>\n")
        first = [r for r in rows if "/" not in r["session"]]
        assert all('"name": "calculator"' in decode(r["prompt_ids"]) for r in first)  # smolagents' tools, through the template
