"""Flow defaults that follow the data: a data file brings real-task lengths and the generic
numeric reward; the addition task keeps its own."""

from __future__ import annotations

import json
from pathlib import Path

from hfrt.flows.config import DATA_DEFAULTS
from hfrt.flows.grpo_family import GRPOFlowConfig
from hfrt.flows.ppo_family import PPOConfig
from hfrt.flows.tasks import numeric_reward, task_reward


def test_a_data_file_brings_its_own_defaults_and_explicit_settings_win(tmp_path: Path) -> None:
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+3?", "ground_truth": "5"}) + "\n")
    toy = PPOConfig.read({})
    assert (toy.max_new_tokens, toy.entropy_coeff) == (2, 0.01)  # the addition task's
    real = PPOConfig.read({"data": str(data)})
    assert real.max_new_tokens == DATA_DEFAULTS["max_new_tokens"] == 64 and real.entropy_coeff == 0.0
    mine = GRPOFlowConfig.read({"data": str(data), "max_new_tokens": 64, "entropy_coeff": 0.001})
    assert (mine.max_new_tokens, mine.entropy_coeff) == (64, 0.001)


def test_the_default_reward_scores_a_data_files_rows_numerically() -> None:
    # the addition task's own rows: its rule reward (form credit, the number must end)
    assert task_reward("7 ", "7") == 1.0 and task_reward("77", "7") == 0.1 and task_reward("x", "7", "addition") == 0.0
    # any other data source: the final answer's last number against the ground truth's
    assert task_reward("3 apples and 4 more make 7.", "7", "gsm8k") == 1.0
    assert task_reward("The answer is 7. Check: 3+4", "7", "gsm8k") == 0.0  # the last number is 4
    assert task_reward("#### 1,234", "1234", "gsm8k") == 1.0
    assert task_reward("\\boxed{0.5} since 1/2", "0.5", "math") == 1.0
    assert task_reward("I think 12", "twelve", "trivia") == 0.0 and numeric_reward(" Twelve ", "twelve") == 1.0
    assert numeric_reward("", "3") == 0.0


def test_addition_sums_are_drawn_uniformly() -> None:
    """With independent addends the sum 2 of 0-4 came a third of the time, and the embedded PPO
    run settled on always answering 2 (accuracy 0.44); every sum now comes as often."""
    from collections import Counter

    from hfrt.flows.tasks import AdditionTask

    rows = AdditionTask(seed=0, max_operand=2).batch(5000)
    counts = Counter(rows["ground_truth"])
    assert sorted(counts) == ["0", "1", "2", "3", "4"]
    assert max(counts.values()) < 1.15 * min(counts.values())
    assert all(0 <= int(p[0]) <= 2 and 0 <= int(p[2]) <= 2 for p in rows["prompt"])  # still a+b with a, b <= 2


def test_the_ppo_flows_defaults_are_the_ones_that_learn() -> None:
    """The defaults docs/flows.md states for the `ppo` flow and for PPOConfig."""
    from hfrt.flows.recipes import ppo

    cfg = ppo.Config.read({})
    assert (cfg.steps, cfg.prompts_per_step, cfg.kl_coef, cfg.val_every, cfg.val_before_train) == (500, 64, 0.1, 100, True)
    assert PPOConfig.read({}).kl_coef == 0.001  # the base (Safe-RLHF's) keeps verl's


def test_the_flow_reads_its_config_once_and_hands_it_over() -> None:
    """Flow.check reads the dict into the flow's Config; Flow.run hands the flow that very object
    (and a flow calling Config.read on it gets it back); a flow without Config gets the dict."""
    import asyncio

    from hfrt.flows import Flow, load_flow

    seen: list[object] = []

    async def record(ctl: object, config: object) -> dict[str, object]:
        seen.append(config)
        return {}

    grpo = load_flow("grpo")
    flow = Flow("grpo-like", record, grpo.roles, grpo.config_cls)
    config = {"steps": 3, "n": 4, "run_dir": ""}
    flow.check(config)
    asyncio.run(flow.run(None, dict(config)))
    assert isinstance(seen[0], GRPOFlowConfig) and seen[0] is flow.read(config)
    assert GRPOFlowConfig.read(seen[0]) is seen[0] and seen[0].n == 4
    asyncio.run(flow.run(None, {**config, "n": 2}))  # another dict: read again
    assert seen[1].n == 2
    asyncio.run(Flow("plain", record).run(None, {"rounds": 5}))
    assert seen[2] == {"rounds": 5}


def test_policy_loss_mode_is_one_setting_with_the_actor_loss_spelling_as_its_alias() -> None:
    import pytest

    cfg = GRPOFlowConfig.read({"actor_loss": {"policy_loss_mode": "gspo", "clip_ratio_c": 5.0}})
    assert cfg.policy_loss_mode == "gspo" and "policy_loss_mode" not in cfg.actor_loss
    assert cfg.actor_update_options()["policy_loss_mode"] == "gspo" and cfg.actor_update_options()["clip_ratio_c"] == 5.0
    same = GRPOFlowConfig.read({"policy_loss_mode": "gspo", "actor_loss": {"policy_loss_mode": "gspo"}})
    assert same.actor_update_options() == GRPOFlowConfig.read({"policy_loss_mode": "gspo"}).actor_update_options()
    with pytest.raises(ValueError, match="the same setting given twice; set policy_loss_mode only"):
        GRPOFlowConfig.read({"policy_loss_mode": "cispo", "actor_loss": {"policy_loss_mode": "gspo"}})
