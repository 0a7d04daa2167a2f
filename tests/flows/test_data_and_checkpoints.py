"""Prompt sources (the addition task, JSONL / Parquet files) with their saved positions, and run
checkpoints: atomic (a failed save changes nothing), pruned, found again by `latest`, and a
damaged one passed over for the previous whole one; data files checked before launch."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows import data as data_module
from hfrt.flows.checkpoint import (
    CheckpointError,
    find_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
)
from hfrt.flows.config import FlowConfig
from hfrt.flows.data import DatasetError, FileDataset, check_data_file, make_source, read_rows, validation_rows
from hfrt.flows.report import MetricsLog
from hfrt.flows.tasks import AdditionTask


def test_addition_task_resumes_where_it_stopped() -> None:
    task = AdditionTask(seed=3, max_operand=9)
    task.batch(5)
    saved = json.loads(json.dumps(task.state_dict()))  # survives the trip through state.json
    expected = task.batch(4)
    again = AdditionTask(seed=3, max_operand=9)
    again.load_state_dict(saved)
    assert again.batch(4) == expected


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_are_normalised(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "2+2=", "ground_truth": 4},
        {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "x"}, "data_source": "chat",
         "extra_info": {"index": 3, "nested": {"dropped": 1}}},
    ])
    rows = read_rows(path)
    assert rows[0] == {"prompt": "2+2=", "ground_truth": "4", "data_source": "train", "extra_info": {}}
    assert rows[1]["prompt"] == [{"role": "user", "content": "hi"}]
    assert rows[1]["ground_truth"] == "x" and rows[1]["data_source"] == "chat" and rows[1]["extra_info"] == {"index": 3}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\nnot json\n', r"train.jsonl:2: not JSON"),
        ('{"prompt": 5}\n', r"row 1: 'prompt' must be a string or a list"),
        ('[1]\n', r"row 1: expected an object"),
        ("", "no rows"),
    ],
)
def test_bad_data_files_name_the_row(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        read_rows(path)


def test_parquet_file(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is in the `flows` extra")
    import pyarrow as pa

    table = pa.table({"prompt": ["1+1=", "1+2="], "ground_truth": ["2", "3"], "data_source": ["p", "p"]})
    pq.write_table(table, tmp_path / "train.parquet")
    rows = read_rows(tmp_path / "train.parquet")
    assert [r["ground_truth"] for r in rows] == ["2", "3"] and rows[0]["data_source"] == "p"


def test_file_dataset_epochs_and_resume(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "ground_truth": str(i)} for i in range(5)])
    data = FileDataset(path, seed=1)
    first_epoch = data.batch(5)["prompt"]
    assert sorted(first_epoch) == [f"p{i}" for i in range(5)]  # every row once per epoch
    data.batch(3)  # into the second epoch, in a different order
    assert data.state_dict()["epoch"] == 1 and data.state_dict()["position"] == 3
    expected = data.batch(6)["prompt"]
    fresh = FileDataset(path, seed=1)
    fresh.load_state_dict(json.loads(json.dumps({"path": str(path), "rows": 5, "epoch": 1, "position": 3})))
    assert fresh.batch(6)["prompt"] == expected
    with pytest.raises(DatasetError, match="taken over 9 rows"):
        fresh.load_state_dict({"rows": 9, "epoch": 0, "position": 0})


def test_sources_by_config(tmp_path: Path) -> None:
    assert isinstance(make_source("", seed=0, max_operand=2), AdditionTask)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    assert validation_rows(str(path), seed=0, max_operand=2, count=3)["prompt"] == ["p0", "p1", "p2"]
    held_out = validation_rows("", seed=0, max_operand=9, count=8)
    assert held_out == validation_rows("", seed=0, max_operand=9, count=8)  # fixed across calls
    assert held_out["prompt"] != AdditionTask(0, 9).batch(8)["prompt"]  # not the training stream


class FakeRole:
    """Stands in for a role group's save/load endpoints (the logic under test is the controller's)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loaded: list[str] = []

    async def save(self, path: str, *, timeout_s: float) -> list[str]:
        Path(path).mkdir(parents=True)
        (Path(path) / "weights").write_text("w")
        if self.fail:
            raise RuntimeError("disk full")
        return [path]

    async def load(self, path: str, *, timeout_s: float) -> list[dict[str, int]]:
        self.loaded.append(path)
        return [{"steps": 1}]


def test_checkpoints_are_atomic_and_pruned(tmp_path: Path) -> None:
    actor = FakeRole()
    for step in (2, 4, 6, 8):
        asyncio.run(save_checkpoint(tmp_path, step, {"actor": actor}, {"data": {"position": step}}, timeout_s=5))
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 8 and ckpt.state["data"] == {"position": 8}
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006", "step_00000008"]
    with pytest.raises(RuntimeError, match="disk full"):
        asyncio.run(save_checkpoint(tmp_path, 10, {"actor": FakeRole(fail=True)}, {}, timeout_s=5))
    again = latest_checkpoint(tmp_path)
    assert again is not None and again.step == 8  # the failed save left the last whole one in place
    assert not (tmp_path / "checkpoints" / "step_00000010").exists()
    asyncio.run(load_checkpoint(again, {"actor": actor}, timeout_s=5))
    assert actor.loaded == [str(again.path / "actor")]
    with pytest.raises(ValueError, match=r"holds role\(s\) \['actor'\]"):
        asyncio.run(load_checkpoint(again, {}, timeout_s=5))


def _two_checkpoints(run_dir: Path) -> Path:
    """Whole checkpoints at steps 2 and 4 (latest: 4), as the Trainer writes them."""
    for step in (2, 4):
        asyncio.run(save_checkpoint(run_dir, step, {"actor": FakeRole(), "critic": FakeRole()}, {"data": {"position": step}}, timeout_s=5))
    return run_dir / "checkpoints" / "step_00000004"


def _edit_state(folder: Path, **changes: Any) -> None:
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps(state | changes))


DAMAGES = {
    "truncated": (lambda f: (f / "state.json").write_text('{"step": 4, "ro'), "state.json is not readable JSON"),
    "garbage": (lambda f: (f / "state.json").write_bytes(b"\x00\xff\x13garbage"), "state.json is not readable JSON"),
    "missing": (lambda f: (f / "state.json").unlink(), "no state.json"),
    "not an object": (lambda f: (f / "state.json").write_text("[4]"), "state.json holds list, not an object"),
    "step a string": (lambda f: _edit_state(f, step="4"), "step '4' is not a positive integer"),
    "step a bool": (lambda f: _edit_state(f, step=True), "step True is not a positive integer"),
    "step not the folder's": (lambda f: _edit_state(f, step=3), "state.json says step 3, the folder's name says 4"),
    "roles not a list": (lambda f: _edit_state(f, roles="actor"), "'roles' must be a list of role names"),
    "role outside": (lambda f: _edit_state(f, roles=["../../x"]), "'roles' must be a list of role names"),
    "role files gone": (lambda f: __import__("shutil").rmtree(f / "critic"), "role 'critic' has no saved files"),
    "role folder empty": (lambda f: (f / "critic" / "weights").unlink(), "role 'critic' has no saved files"),
    "data not an object": (lambda f: _edit_state(f, data=[1]), "'data' (the data position) must be an object"),
    "flow state not an object": (lambda f: _edit_state(f, flow=3), "'flow' must be an object"),
    "latest outside": (lambda f: (f.parent / "latest").write_text("../../../etc\n"),
                       "latest names '../../../etc', which is not a checkpoint folder of this run"),
    "latest missing folder": (lambda f: (f.parent / "latest").write_text("step_00000006\n"), "names step_00000006, which does not exist"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_whole_one(tmp_path: Path, damage: str) -> None:
    newest = _two_checkpoints(tmp_path)
    make, message = DAMAGES[damage]
    make(newest)
    found = find_checkpoint(tmp_path, max_step=10)
    whole = 4 if damage.startswith("latest") else 2  # a bad pointer: the newest folder is still whole
    assert found.checkpoint is not None and found.checkpoint.step == whole
    assert found.checkpoint.state["data"] == {"position": whole}
    assert message in found.damaged[0], found.damaged
    assert latest_checkpoint(tmp_path, max_step=10) == found.checkpoint  # what the Trainer's resume loads


def test_a_checkpoint_beyond_the_run_is_passed_over(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    found = find_checkpoint(tmp_path, max_step=3)
    assert found.checkpoint is not None and found.checkpoint.step == 2
    assert found.damaged == [f"checkpoint {tmp_path}/checkpoints/step_00000004: step 4 is beyond this run's 3 steps"]
    assert find_checkpoint(tmp_path).checkpoint.step == 4  # type: ignore[union-attr]


def test_no_whole_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    assert resumable_checkpoint(tmp_path).checkpoint is None  # no checkpoints at all: start from step 0
    newest = _two_checkpoints(tmp_path)
    (newest / "state.json").write_text("{")
    (tmp_path / "checkpoints" / "step_00000002" / "state.json").write_text('{"step": "two"}')
    with pytest.raises(CheckpointError, match="no whole checkpoint to resume from: .*step_00000004: state.json is not readable JSON.*"
                                              "step_00000002: step 'two' is not a positive integer"):
        resumable_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\n\n"just a string"\n', r"train.jsonl:3: expected an object, got str"),
        ('{"prompt": "a"}\n{"question": "a"}\n', r"train.jsonl:2: missing key 'prompt' \(a row has \['question'\]\)"),
        ('{"prompt": ["a"]}\n', r"train.jsonl:1: 'prompt' must be a string or a list"),
        ('{"prompt": "a"}\n{"prompt": \n', r"train.jsonl:2: not JSON"),
        (b'{"prompt": "\xff"}\n', r"train.jsonl:1: not JSON"),
        ("\n \n", r"train.jsonl: no rows"),
    ],
)
def test_data_file_check_names_the_line(tmp_path: Path, content: str | bytes, message: str) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DatasetError, match=message):
        check_data_file(path)
    with pytest.raises(ValueError, match=message):
        FlowConfig(data=str(path))
    with pytest.raises(ValueError, match=message):
        FlowConfig(val_data=str(path))


def test_a_large_data_file_has_its_first_rows_checked_and_all_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt": "a"}\n' * 5 + "[1]\n" + '{"prompt": "b"}\n' * 3)
    with pytest.raises(DatasetError, match="big.jsonl:6: expected an object"):
        check_data_file(path)
    monkeypatch.setattr(data_module, "CHECK_ALL_BYTES", 10)
    monkeypatch.setattr(data_module, "CHECK_ROWS", 5)
    assert check_data_file(path) == 9  # row 6 is beyond the rows a large file has checked
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "p"}] * 4)
    assert check_data_file(good) == 4


def test_json_and_parquet_files_are_checked(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text('[{"prompt": "a"}, ')
    with pytest.raises(DatasetError, match=r"d.json: not JSON"):
        check_data_file(tmp_path / "d.json")
    (tmp_path / "d.json").write_text('[{"prompt": "a"}, {"prompt": null}]')
    with pytest.raises(DatasetError, match=r"d.json: row 2: 'prompt' must be"):
        check_data_file(tmp_path / "d.json")
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is in the `flows` extra")
    import pyarrow as pa

    pq.write_table(pa.table({"prompt": ["1+1=", "1+2=", "1+3="]}), tmp_path / "ok.parquet")
    assert check_data_file(tmp_path / "ok.parquet") == 3
    pq.write_table(pa.table({"question": ["1+1="]}), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet: row 1: missing key 'prompt'"):
        check_data_file(tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"junk.parquet: not a readable Parquet file"):
        check_data_file(tmp_path / "junk.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match=r"empty.parquet: no rows"):
        check_data_file(tmp_path / "empty.parquet")


def test_metrics_log_truncates_to_the_checkpoint(tmp_path: Path) -> None:
    with MetricsLog(str(tmp_path)) as log:
        for step in range(5):
            log.write({"step": step, "reward/mean": step / 10})
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 5, "rew')  # a line cut short by kill -9
    with MetricsLog(str(tmp_path)) as log:
        log.truncate(3)
        log.write({"step": 3, "reward/mean": 0.9})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3] and log.rewards == [0.0, 0.1, 0.2, 0.9]


def test_task_reward_and_cost_read_ascii_digits_only() -> None:
    """A byte-level policy can emit '¹' or '٣' (str.isdigit is true for both): no crash, no credit."""
    from hfrt.flows.tasks import FORM_CREDIT, addition_cost, addition_reward

    assert addition_reward("7 ", "7") == 1.0 and addition_reward("77", "7") == FORM_CREDIT
    assert addition_reward("¹", "1") == 0.0 and addition_reward("٣", "3") == 0.0 and addition_reward("3¹", "3") == 1.0
    assert addition_cost("7", "7") == 0.0 and addition_cost("¹", "1") == 1.0 and addition_cost("", "1") == 1.0
