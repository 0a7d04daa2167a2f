"""The recorded-conversation files (hfrt.serve.record) without a server: a session's exact
trajectories are one write of whole lines; a write that comes back short is cut back, so the file
holds whole conversations only; a reader skips a last line a crash cut and names any other bad line;
reward lines apply to their session's trajectories in the same file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hfrt.serve import record as rec
from hfrt.serve.record import Recorder, RecordError, read_recorded
from hfrt.serve.sessions import Session, SessionCall


def session(*calls: tuple[list[int], list[int]]) -> Session:
    return Session([SessionCall(p, o, [-0.5] * len(o), 3) for p, o in calls], answer="hi")


def test_a_session_is_written_whole_and_rewards_join_it(tmp_path: Path) -> None:
    r = Recorder(tmp_path, model="m")
    # a client that re-rendered its history: two exact trajectories (part 0 and 1), one write
    assert r.conversation("a", session(([1, 2], [3]), ([1, 2, 3, 4], [5, 6]), ([9], [7]))) == 2
    r.conversation("b", session(([1], [2])), reward=1.0)
    r.reward("a", 0.5)
    r.close()
    lines = [json.loads(x) for x in r.path.read_text().splitlines()]
    assert [(x["kind"], x.get("part")) for x in lines] == [("trajectory", 0), ("trajectory", 1), ("trajectory", 0), ("reward", None)]
    assert lines[0]["gen_mask"] == [1, 0, 1, 1] and lines[0]["log_probs"] == [-0.5, 0.0, -0.5, -0.5] and lines[0]["turns"] == 2
    assert lines[0]["policy_version"] == 3 and lines[0]["model"] == "m" and lines[0]["answer"] == "hi"
    assert [x["reward"] for x in read_recorded(tmp_path)] == [0.5, 0.5, 1.0]


def test_a_short_write_is_cut_back_and_a_crash_cut_line_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = Recorder(tmp_path)
    r.conversation("whole", session(([1], [2])), reward=0.0)
    size = r.path.stat().st_size
    real = os.write

    def short(fd: int, data: bytes) -> int:
        return real(fd, data[: len(data) // 2])

    monkeypatch.setattr(rec.os, "write", short)
    with pytest.raises(OSError, match=r"wrote \d+ of \d+ bytes of a conversation; cut back"):
        r.conversation("half", session(([1], [2])), reward=0.0)
    monkeypatch.setattr(rec.os, "write", real)
    assert r.path.stat().st_size == size  # nothing of "half" is left
    r.close()
    with r.path.open("a") as f:  # what a crash inside a write leaves: a line without its newline
        f.write('{"kind": "trajectory", "format": 1, "prompt')
    assert [x["session"] for x in read_recorded(r.path)] == ["whole"]


@pytest.mark.parametrize(("line", "message"), [
    ("not json", r"line 1 is not JSON"),
    ('{"kind": "note"}', r"line 1 has kind 'note'"),
    ('{"kind": "trajectory", "format": 2}', r"line 1: format 2; this hfrt reads format 1"),
    ('{"kind": "trajectory", "format": 1, "prompt_ids": [1], "response_ids": [2], "gen_mask": [], "log_probs": [0]}',
     r"line 1: prompt_ids, and response_ids / gen_mask / log_probs of one length"),
])
def test_a_bad_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "conversations-x.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(RecordError, match=message):
        read_recorded(tmp_path)


def test_a_folder_without_recordings_is_named(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match=r"holds no conversations-\*.jsonl file"):
        read_recorded(tmp_path)


def test_the_replay_config_reads_rewards_or_a_reward_function(tmp_path: Path) -> None:
    from hfrt.flows.agent.replay import AgentReplayConfig, replay_columns

    r = Recorder(tmp_path)
    r.conversation("a", session(([1, 2], [3])))
    r.conversation("b", session(([4], [5])), reward=1.0)
    r.close()
    with pytest.raises(ValueError, match=r"config data: 1 recorded trajectories have no reward \(first: session 'a'"):
        AgentReplayConfig.read({"data": str(tmp_path)})
    with pytest.raises(ValueError, match=r"config estimator='grpo'"):
        AgentReplayConfig.read({"data": str(tmp_path), "estimator": "grpo", "reward_function": "tests.serve.test_record:two"})
    cfg = AgentReplayConfig.read({"data": str(tmp_path), "reward_function": "tests.serve.test_record:two"})
    train, val = cfg.rows()
    assert val == [] and [row["reward"] for row in train] == [2.0, 1.0]
    cols: dict[str, Any] = replay_columns(train)
    assert cols["response_gen_mask"] == [[1], [1]] and cols["uid"] == ["a/0", "b/0"] and cols["weight_version"] == [3, 3]


def two(answer: str, sample: dict[str, Any]) -> float:
    assert answer == "hi" and sample["session"] == "a"
    return 2.0
