"""Sampled validation (val_temperature, val_n: verl's `val_kwargs`) and the evaluation-only run
(val_only: verl's `trainer.val_only`), without processes: the actor's generate call a pass makes,
accuracy as the mean over every sample, the config checks, and the Trainer's val_only path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.batches import non_tensor
from hfrt.flows.config import FlowConfig
from hfrt.flows.reward_errors import RewardErrors
from hfrt.flows.tasks import AdditionTask
from hfrt.flows.trainer import Trainer, sampling_seed, validation_seed
from hfrt.flows.validation import Validator
from hfrt.protocols import BatchHandle


class SamplingGroup:
    """An actor and reward role in one: generate repeats each prompt `n` times (as the actor's rollout
    does), score gives sample j of a row the score 1 when j < the row's ground truth (so a row with
    truth k has k right samples out of n)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def generate(self, prompts: BatchHandle, **kw: Any) -> BatchHandle:
        self.calls.append({k: v for k, v in kw.items() if k != "timeout_s"})
        n = int(kw.get("n", 1))
        truths = non_tensor(prompts, "ground_truth")
        return BatchHandle.inline({"sample": list(range(n)) * len(truths), "ground_truth": [t for t in truths for _ in range(n)]})

    async def score(self, rollout: BatchHandle, **kw: Any) -> BatchHandle:
        pairs = zip(non_tensor(rollout, "sample"), non_tensor(rollout, "ground_truth"), strict=True)
        scores = [1.0 if j < int(truth) else 0.0 for j, truth in pairs]
        return BatchHandle.inline({"score": scores, "score_error": [""] * len(scores)})


class Counted:
    """A task of two validation rows whose ground truths are right-sample counts (3 and 0)."""

    name = "counted"

    def prompts(self) -> AdditionTask:
        return AdditionTask(seed=0, max_operand=2)  # the Trainer opens the stream; val_only reads none of it

    def validation_rows(self, count: int) -> dict[str, list[Any]]:
        return {"prompt": ["a", "b"], "ground_truth": ["3", "0"], "data_source": ["counted"] * 2}

    def correct(self, score: float) -> bool:
        return score >= 1.0


def validator(group: SamplingGroup, **kw: Any) -> Validator:
    return Validator(Counted(), group, group, count=2, max_new_tokens=5, errors=RewardErrors(), timeout_s=5, **kw)


async def test_greedy_is_the_default_and_sends_no_n_or_seed() -> None:
    group = SamplingGroup()
    metrics = await validator(group).run()
    assert group.calls == [{"temperature": 0.0, "max_new_tokens": 5}]  # as before val_temperature existed
    assert metrics == {"val/reward_mean": 0.5, "val/accuracy": 0.5}  # one sample per row: rows a (right) and b


async def test_sampled_validation_is_the_mean_over_every_sample_with_a_fixed_seed() -> None:
    group = SamplingGroup()
    v = validator(group, temperature=1.0, n=4, seed=17)
    first, second = await v.run(), await v.run()
    assert group.calls == [{"temperature": 1.0, "max_new_tokens": 5, "n": 4, "seed": 17}] * 2  # the same draw each pass
    assert first == second == {"val/reward_mean": 3 / 8, "val/accuracy": 3 / 8}  # 3 of a's 4, none of b's 4


def test_greedy_with_several_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="n=4 greedy responses per row would all be the same"):
        validator(SamplingGroup(), n=4)


def read(**settings: Any) -> FlowConfig:
    return FlowConfig.read({"progress": "off", "tensorboard": False} | settings)


def test_the_config_keys_and_their_checks() -> None:
    cfg = read(val_temperature=0.7, val_n=8)
    assert (cfg.val_temperature, cfg.val_n, cfg.val_only) == (0.7, 8, False)
    assert (read().val_temperature, read().val_n) == (0.0, 1)
    with pytest.raises(ValueError, match=r"val_n=4: greedy validation \(val_temperature=0\) gives one answer"):
        read(val_n=4)
    with pytest.raises(ValueError, match="val_n=0: must be at least 1"):
        read(val_n=0, val_temperature=1.0)
    with pytest.raises(ValueError, match="val_temperature=-1.0: must not be negative"):
        read(val_temperature=-1.0)


def test_the_validation_seed_is_none_of_the_steps_seeds() -> None:
    cfg = read(seed=3)
    assert validation_seed(cfg) not in {sampling_seed(cfg, step) for step in range(100_000)}
    assert validation_seed(cfg) != validation_seed(read(seed=4))


class FakeController:
    recovery = None

    def stats(self) -> dict[str, Any]:
        return {"controller_bulk_bytes": 0, "unmatched_replies": 0}


async def test_val_only_validates_the_starting_weights_and_runs_no_step(tmp_path: Path) -> None:
    group = SamplingGroup()
    cfg = read(val_only=True, val_temperature=1.0, val_n=4, val_prompts=2, run_dir=str(tmp_path), export_hf=True)
    trainer = Trainer(FakeController(), cfg, {"actor": group, "reward": group}, task=Counted())  # type: ignore[arg-type]

    async def step(i: int, prompts: BatchHandle) -> dict[str, Any]:
        raise AssertionError("val_only runs no step")

    summary = await trainer.run(step)
    assert summary == {"val_only": True, "steps": 0, "val/reward_mean": 3 / 8, "val/accuracy": 3 / 8,
                       "val_prompts": 2, "val_temperature": 1.0, "val_n": 4}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 0 and records[0]["val/accuracy"] == 3 / 8
    assert not (tmp_path / "hf").exists()


def test_a_flow_without_validation_refuses_val_only() -> None:
    from hfrt.flows.agent.grpo import AgentGRPOConfig

    with pytest.raises(ValueError, match="val_only=true: agent_calc has no validation pass"):
        AgentGRPOConfig.read({"val_only": True, "progress": "off"})
