"""The Trainer's components without processes: the validator's accuracy under a task's own rule, the
checkpoint manager's save / resume / rewind / initial-weights decisions, the metrics processor's
records, the export, the tasks a config names, and the Trainer's loop wiring them (role groups and
the controller stand in as small fakes: the logic under test is the controller side's)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.batches import non_tensor
from hfrt.flows.checkpoint import CheckpointError
from hfrt.flows.checkpoint_manager import CheckpointManager
from hfrt.flows.config import FlowConfig
from hfrt.flows.data import BuiltinAddition, DataFileTask, PromptSource, Task, config_task, make_source, validation_rows
from hfrt.flows.export import HFExport
from hfrt.flows.metrics_processor import MetricsProcessor
from hfrt.flows.report import MetricsLog
from hfrt.flows.reward_errors import ERRORS_KEY, RewardErrorLimit, RewardErrors
from hfrt.flows.tasks import AdditionTask
from hfrt.flows.trainer import Trainer
from hfrt.flows.validation import Validator, before_training, validation_metrics
from hfrt.protocols import BatchHandle


class FakeGroup:
    """A role group's endpoints as the Trainer's components call them: generate echoes the prompts,
    score reads each row's ground truth as its score, save / load write and note a folder."""

    def __init__(self, *, version: int = 0, advantage: bool = False) -> None:
        self.endpoints = {"generate", "score", "save", "load", "export_hf", "weight_version"}
        if advantage:
            self.endpoints |= {"advantage_state", "load_advantage_state"}
        self.version, self.advantage = version, {"baseline": 0.25}
        self.loaded: list[str] = []
        self.exported: list[str] = []
        self.generated: list[list[Any]] = []

    async def generate(self, prompts: BatchHandle, **kw: Any) -> BatchHandle:
        assert kw["temperature"] == 0.0 and kw["max_new_tokens"] > 0
        self.generated.append(non_tensor(prompts, "prompt"))
        return prompts

    async def score(self, rollout: BatchHandle, **kw: Any) -> BatchHandle:
        truths = non_tensor(rollout, "ground_truth")
        return BatchHandle.inline({"score": [float(t) for t in truths], "score_error": [""] * len(truths)})

    async def save(self, path: str, **kw: Any) -> list[str]:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "weights").write_text("w")
        return [path]

    async def load(self, path: str, **kw: Any) -> list[dict[str, int]]:
        self.loaded.append(path)
        return [{"steps": 1}]

    async def weight_version(self, **kw: Any) -> list[int]:
        return [self.version]

    async def advantage_state(self, **kw: Any) -> dict[str, float]:
        return dict(self.advantage)

    async def load_advantage_state(self, state: dict[str, float], **kw: Any) -> None:
        self.advantage = dict(state)

    async def export_hf(self, path: str, **kw: Any) -> None:
        self.exported.append(path)


class FakeController:
    """The controller's counters the metrics read; no recovery."""

    recovery = None

    def stats(self) -> dict[str, Any]:
        return {"controller_bulk_bytes": 0, "unmatched_replies": 0}


@dataclass(frozen=True)
class Graded:
    """A task whose validation rows score 1.0, 0.6, 0.1 and 0.0 (their ground truths, as FakeGroup
    scores them) and which counts a score of at least `threshold` as right."""

    threshold: float = 0.5
    name: str = "graded"

    def prompts(self) -> PromptSource:
        return AdditionTask(seed=5, max_operand=3)

    def validation_rows(self, count: int) -> dict[str, list[Any]]:
        truths = ["1.0", "0.6", "0.1", "0.0"]
        return {"prompt": [f"q{i}" for i in range(4)], "ground_truth": truths, "data_source": ["graded"] * 4}

    def correct(self, score: float) -> bool:
        return score >= self.threshold


def validator(task: Task, errors: RewardErrors | None = None) -> Validator:
    return Validator(task, FakeGroup(), FakeGroup(), count=4, max_new_tokens=2, errors=errors or RewardErrors(), timeout_s=5)


# -- validation ---------------------------------------------------------------------------------


async def test_the_validator_counts_what_the_task_calls_right() -> None:
    assert await validator(Graded()).run() == {"val/reward_mean": pytest.approx(0.425), "val/accuracy": 0.5}
    assert (await validator(Graded(threshold=1.0)).run())["val/accuracy"] == 0.25  # the built-in rule: score >= 1
    assert (await validator(Graded(threshold=0.05)).run())["val/accuracy"] == 0.75


async def test_the_validator_reads_its_rows_once_and_answers_greedily() -> None:
    v = validator(Graded())
    await v.run()
    await v.run()
    assert v.actor.generated == [["q0", "q1", "q2", "q3"]] * 2
    assert v.rows() is v.rows()


def test_validation_metrics_and_the_pass_before_training() -> None:
    metrics = validation_metrics([1.0, 0.1, 0.0, 1.0], BuiltinAddition())
    assert metrics == {"val/reward_mean": pytest.approx(0.525), "val/accuracy": 0.5}
    assert before_training(metrics) == {"val_before/reward_mean": pytest.approx(0.525), "val_before/accuracy": 0.5}
    with pytest.raises(ValueError, match="validation of task 'addition': the reward role returned no scores"):
        validation_metrics([], BuiltinAddition())


async def test_validation_without_a_reward_role_names_it() -> None:
    v = Validator(Graded(), FakeGroup(), None, count=4, max_new_tokens=2, errors=RewardErrors(), timeout_s=5)
    with pytest.raises(ValueError, match="needs the actor and reward roles; this flow gave the Trainer no reward"):
        await v.run()


# -- tasks --------------------------------------------------------------------------------------


def test_the_tasks_a_config_names(tmp_path: Path) -> None:
    rows = tmp_path / "math.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"p{i}", "ground_truth": str(i)}) + "\n" for i in range(5)))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "h", "ground_truth": "1"}) + "\n")
    addition = config_task(data="", val_data="", seed=3, max_operand=9)
    assert isinstance(addition, BuiltinAddition) and addition.name == "addition"
    assert addition.prompts().batch(6) == make_source("", seed=3, max_operand=9).batch(6)  # as before the Task existed
    assert addition.validation_rows(8) == validation_rows("", seed=3, max_operand=9, count=8)
    assert addition.correct(1.0) and not addition.correct(0.1)  # FORM_CREDIT is not right
    data = config_task(data=str(rows), val_data="", seed=1, max_operand=2)
    assert isinstance(data, DataFileTask) and data.name == "math"
    assert data.validation_rows(2)["prompt"] == ["p0", "p1"] and len(data.validation_rows(0)["prompt"]) == 5
    assert config_task(data=str(rows), val_data=str(held), seed=1, max_operand=2).validation_rows(0)["prompt"] == ["h"]
    assert config_task(data="", val_data=str(held), seed=1, max_operand=2).validation_rows(0)["prompt"] == ["h"]
    with pytest.raises(ValueError, match="DataFileTask: path is empty"):
        DataFileTask("")


# -- checkpoints --------------------------------------------------------------------------------


def manager(run_dir: Path, actor: FakeGroup | None = None, steps: int = 10) -> CheckpointManager:
    actor = actor if actor is not None else FakeGroup(advantage=True)
    return CheckpointManager(str(run_dir), max_step=steps, trained={"actor": actor}, source=AdditionTask(seed=1),
                             actor=actor, timeout_s=5)


async def test_a_checkpoint_holds_the_data_position_and_advantage_state_and_resumes_them(tmp_path: Path) -> None:
    saving = manager(tmp_path)
    saving.source.batch(7)
    await saving.save(3)
    state = json.loads((tmp_path / "checkpoints" / "step_00000003" / "state.json").read_text())
    assert state["step"] == 3 and state["roles"] == ["actor"] and state["advantage"] == {"baseline": 0.25}
    actor = FakeGroup(advantage=True)
    actor.advantage = {}
    resuming = manager(tmp_path, actor)
    ckpt = await resuming.resume()
    assert ckpt is not None and ckpt.step == 3
    assert actor.loaded == [str(ckpt.path / "actor")] and actor.advantage == {"baseline": 0.25}
    assert resuming.source.batch(4) == saving.source.batch(4)  # the data stream goes on where it stopped


async def test_resume_and_rewind_pick_the_newest_whole_checkpoint(tmp_path: Path) -> None:
    chk = manager(tmp_path)
    assert chk.latest() is None and await chk.resume() is None  # nothing saved yet: start from step 0
    no_folder = CheckpointManager("", max_step=10, trained={}, source=AdditionTask(), timeout_s=5)
    assert no_folder.latest() is None  # a run without a folder has nothing to resume
    for step in (2, 4):
        await chk.save(step)
    latest = chk.latest()
    assert latest is not None and latest.step == 4
    (tmp_path / "checkpoints" / "step_00000004" / "state.json").write_text("{")
    fallback = chk.latest()
    assert fallback is not None and fallback.step == 2  # the damaged newest one is passed over
    (tmp_path / "checkpoints" / "step_00000002" / "state.json").write_text("{")
    with pytest.raises(CheckpointError, match="no whole checkpoint to resume from"):
        chk.latest()  # all damaged: an error, never a silent fresh start


async def test_a_checkpoint_beyond_the_run_is_not_resumed(tmp_path: Path) -> None:
    await manager(tmp_path).save(4)
    with pytest.raises(CheckpointError, match="step 4 is beyond this run's 3 steps"):
        manager(tmp_path, steps=3).latest()


async def test_an_advantage_state_needs_an_actor_to_go_to(tmp_path: Path) -> None:
    await manager(tmp_path).save(2)
    ckpt = manager(tmp_path).latest()
    assert ckpt is not None
    no_actor = CheckpointManager(str(tmp_path), max_step=10, trained={"actor": FakeGroup()}, source=AdditionTask(seed=1), timeout_s=5)
    with pytest.raises(ValueError, match="holds an advantage state, and this run has no actor"):
        await no_actor.load(ckpt)


async def test_initial_weights_are_kept_reset_or_continued(tmp_path: Path) -> None:
    fresh = FakeGroup(version=0)
    assert await manager(tmp_path, fresh).initial_weights(str(tmp_path), reset=False) == {}
    assert json.loads((tmp_path / "initial_weights" / "roles.json").read_text()) == ["actor"]  # kept for a reset
    trained = FakeGroup(version=5)
    assert await manager(tmp_path, trained).initial_weights(str(tmp_path), reset=False) == {"started_from_trained_weights": 5}
    assert trained.loaded == []
    assert await manager(tmp_path, trained).initial_weights(str(tmp_path), reset=True) == {"weights_reset": 5}
    assert trained.loaded == [str(tmp_path / "initial_weights" / "actor")]
    assert await manager(tmp_path, trained).initial_weights("", reset=True) == {}  # daemons of this run only


# -- metrics and export -------------------------------------------------------------------------


def test_records_take_out_the_reward_errors_and_add_the_controllers_counters(tmp_path: Path) -> None:
    with MetricsProcessor(FakeController(), MetricsLog(str(tmp_path)), RewardErrors(limit=0.5)) as metrics:  # type: ignore[arg-type]
        record = metrics.step_record(0, {"val_before/accuracy": 0.0}, {"reward/mean": 0.5, ERRORS_KEY: ["", "boom"]})
        assert ERRORS_KEY not in record and record["val_before/accuracy"] == 0.0
        metrics.write(record)
        with pytest.raises(RewardErrorLimit, match="step 1: the reward function failed on 2 of 2 samples"):
            metrics.step_record(1, {}, {"reward/mean": 0.0, ERRORS_KEY: ["boom", "boom"]})
        summary = metrics.summary()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written == {"step": 0, "val_before/accuracy": 0.0, "reward/mean": 0.5, "controller_bulk_bytes": 0,
                       "controller/unmatched_replies": 0}
    assert summary["steps"] == 1 and summary["val_accuracy_first"] == 0.0 and summary["controller_bulk_bytes"] == 0


async def test_the_export_writes_the_actor_only_when_asked(tmp_path: Path) -> None:
    actor = FakeGroup()
    assert await HFExport(str(tmp_path), actor, enabled=True, timeout_s=5).export() == {"hf_export": str(tmp_path / "hf")}
    assert actor.exported == [str(tmp_path / "hf")]
    for export in (HFExport(str(tmp_path), actor, enabled=False, timeout_s=5), HFExport("", actor, enabled=True, timeout_s=5),
                   HFExport(str(tmp_path), None, enabled=True, timeout_s=5)):
        assert await export.export() == {}
    assert len(actor.exported) == 1


# -- the loop -----------------------------------------------------------------------------------


def config(run_dir: Path, **changes: Any) -> FlowConfig:
    settings = {"steps": 3, "prompts_per_step": 2, "val_every": 2, "val_prompts": 4, "checkpoint_every": 2,
                "tensorboard": False, "progress": "off", "run_dir": str(run_dir)}
    return FlowConfig.read(settings | changes)


async def test_the_loop_wires_a_flows_own_task_into_steps_validation_and_checkpoints(tmp_path: Path) -> None:
    roles = {"actor": FakeGroup(advantage=True), "reward": FakeGroup()}
    trainer = Trainer(FakeController(), config(tmp_path), roles, task=Graded())  # type: ignore[arg-type]
    seen: list[list[str]] = []

    async def step(i: int, prompts: BatchHandle) -> dict[str, Any]:
        seen.append(non_tensor(prompts, "prompt"))
        return {"reward/mean": 0.1 * i}

    summary = await trainer.run(step)
    stream = AdditionTask(seed=5, max_operand=3).batch(8)["prompt"]
    assert seen == [stream[0:2], stream[2:4], stream[4:6]]  # the task's own prompt stream
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["val_before/accuracy"] == 0.5 and "val/accuracy" not in records[0]  # Graded's rule, before step 0
    assert records[1]["val/accuracy"] == 0.5 and records[2]["val/accuracy"] == 0.5  # due after step 1 and the last
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]
    assert summary["steps"] == 3 and summary["hf_export"] == str(tmp_path / "hf") and "resumed_from_step" not in summary
    assert summary["val_accuracy_first"] == 0.5 and summary["val_accuracy_last"] == 0.5

    resumed = Trainer(FakeController(), config(tmp_path, steps=4, resume=True), roles, task=Graded())  # type: ignore[arg-type]
    again = await resumed.run(step)
    assert again["resumed_from_step"] == 3 and again["steps"] == 4 and resumed.start_step == 3
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert seen[3:] == [stream[6:8]]  # the stream goes on from the checkpoint's position


def test_by_default_the_task_is_the_one_the_config_names(tmp_path: Path) -> None:
    roles = {"actor": FakeGroup(), "reward": FakeGroup()}
    trainer = Trainer(FakeController(), config(tmp_path, max_operand=7, seed=4), roles)  # type: ignore[arg-type]
    assert trainer.task == BuiltinAddition(seed=4, max_operand=7)
    assert trainer.more_prompts(3) == BatchHandle.inline(AdditionTask(seed=4, max_operand=7).batch(3))


class FakeRecovery:
    """Recovery's side of a rewind: one lost actor daemon, replaced by the time the Trainer settles."""

    def __init__(self) -> None:
        self.lost = {"actor": "exited with code -9"}
        self.rewinds = 0

    async def wait_lost_state(self) -> dict[str, str]:
        return dict(self.lost)

    async def settle(self, groups: list[Any]) -> None:
        pass

    def rewound(self, lost_s: float) -> None:
        self.lost.clear()
        self.rewinds += 1

    def metrics(self) -> dict[str, float]:
        return {"recovery/rewinds": self.rewinds}


class RecoveringController(FakeController):
    def __init__(self) -> None:
        self.recovery = FakeRecovery()  # type: ignore[assignment]


async def test_a_lost_daemon_rewinds_to_the_latest_checkpoint_and_redoes_the_steps(tmp_path: Path) -> None:
    from hfrt.wire.errors import DaemonGone

    actor = FakeGroup(advantage=True)
    trainer = Trainer(RecoveringController(), config(tmp_path, steps=4, val_every=0), {"actor": actor})  # type: ignore[arg-type]
    ran: list[int] = []

    async def step(i: int, prompts: BatchHandle) -> dict[str, Any]:
        if i == 3 and 3 not in ran:
            ran.append(i)
            raise DaemonGone("actor rank 0 exited")
        ran.append(i)
        return {"reward/mean": float(i)}

    summary = await trainer.run(step)
    assert ran == [0, 1, 2, 3, 2, 3]  # step 3 failed: back to the checkpoint after step 2
    assert summary["rewound"] == [[3, 2]] and summary["steps"] == 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[-1]["recovery/rewinds"] == 1
    assert actor.loaded == [str(tmp_path / "checkpoints" / "step_00000002" / "actor")]


async def test_a_lost_daemon_without_a_checkpoint_ends_the_run_saying_so(tmp_path: Path) -> None:
    from hfrt.control.recovery import RecoveryFailed
    from hfrt.wire.errors import DaemonGone

    trainer = Trainer(RecoveringController(), config(tmp_path, val_every=0, checkpoint_every=0), {"actor": FakeGroup()})  # type: ignore[arg-type]

    async def step(i: int, prompts: BatchHandle) -> dict[str, Any]:
        raise DaemonGone("actor rank 0 exited")

    with pytest.raises(RecoveryFailed, match=r"actor died at step 0 \(exited with code -9\) and there is no checkpoint"):
        await trainer.run(step)
