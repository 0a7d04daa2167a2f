"""Recorded conversations (`hfrt serve-openai --record DIR`): every conversation the server served
written as trajectories — token ids, the mask of sampled tokens, their log-probs, the policy
version, the session id, and a reward left empty or given later — one JSON-lines file per server
process, a conversation's lines appended by one write (a short write is cut back, so no line is
ever half there); and the folder read back into training rows (`read_recorded`) for the
agent_replay flow.

A line is one of (FORMAT 1):
- `{"kind": "trajectory", "format": 1, "id", "session", "part", "model", "prompt_ids",
  "response_ids", "gen_mask", "log_probs", "weight_versions", "policy_version", "turns",
  "messages", "text", "answer", "reward", "recorded_at"}` — the fields of
  hfrt.serve.turns.Trajectory (the agent flows' RUN_DIR/trajectories files carry the same
  token fields); `part` counts the exact trajectories of a session whose client re-rendered its
  history (hfrt.serve.sessions.build_trajectories); `reward` is null unless given at its end.
- `{"kind": "reward", "session", "reward", "recorded_at"}` — a reward POSTed for a session after
  it was written; it applies to that session's trajectories in the same file.

It knows the Session / Trajectory records, files and JSON; nothing of HTTP, training or what a
reward means.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hfrt.serve.sessions import Session, build_trajectories
from hfrt.serve.turns import Trajectory

FORMAT = 1
#: the recorded files' names: conversations-HOST-PID-RANDOM.jsonl (one per server process)
PATTERN = "conversations-*.jsonl"


class RecordError(ValueError):
    """A recorded folder or line that cannot be read; the message names the file and line."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def trajectory_line(name: str, part: int, t: Trajectory, session: Session, *, model: str, reward: float | None) -> dict[str, Any]:
    """One trajectory of session `name` as a FORMAT line."""
    messages = session.chat[0] if session.chat is not None else None
    return {
        "kind": "trajectory", "format": FORMAT, "id": uuid.uuid4().hex, "session": name, "part": part, "model": model,
        "prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "gen_mask": t.gen_mask, "log_probs": t.log_probs,
        "weight_versions": t.weight_versions, "policy_version": min(t.weight_versions, default=-1), "turns": t.turns,
        "messages": messages, "text": session.text, "answer": session.answer, "reward": reward, "recorded_at": _now(),
    }


class Recorder:
    """Appends conversations to `folder`/conversations-HOST-PID-RANDOM.jsonl (made on start).
    Each `conversation` or `reward` is one os.write of whole lines on an O_APPEND descriptor,
    then fsync; a write that comes back short is cut back to where it began and raises, so a
    reader never meets half a conversation (and `read_recorded` skips a last line with no
    newline, which only a crash inside the write leaves)."""

    def __init__(self, folder: str | Path, *, model: str = "hfrt") -> None:
        self.folder, self.model = Path(folder), model
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"conversations-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}.jsonl"
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.conversations = self.trajectories = 0

    def conversation(self, name: str, session: Session, reward: float | None = None) -> int:
        """Write session `name` (its exact trajectories, see build_trajectories); how many lines."""
        if not session.calls:
            return 0
        lines = [trajectory_line(name, i, t, session, model=self.model, reward=reward)
                 for i, t in enumerate(build_trajectories(name, session))]
        self._append(lines)
        self.conversations += 1
        self.trajectories += len(lines)
        return len(lines)

    def reward(self, name: str, reward: float) -> None:
        """A reward for session `name`, written after its trajectories were."""
        self._append([{"kind": "reward", "session": name, "reward": float(reward), "recorded_at": _now()}])

    def _append(self, lines: Iterable[dict[str, Any]]) -> None:
        if self._fd is None:
            raise RuntimeError(f"the recorder of {self.path} is closed")
        data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        written = os.write(self._fd, data)
        if written != len(data):  # a full disk: cut the partial lines back off
            os.ftruncate(self._fd, start)
            raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes of a conversation; cut back to {start}")
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def recorded_files(where: str | Path) -> list[Path]:
    """The recorded files of a folder (PATTERN, sorted), or the one file named."""
    path = Path(where)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise RecordError(f"recorded conversations: {path} is neither a folder nor a file")
    files = sorted(path.glob(PATTERN))
    if not files:
        raise RecordError(f"recorded conversations: {path} holds no {PATTERN} file (serve with hfrt serve-openai --record {path})")
    return files


def read_recorded(where: str | Path) -> list[dict[str, Any]]:
    """Every recorded trajectory under `where` (a folder or one file), in file and line order,
    each with its reward: its own, else the last reward line of its session in its file (None
    when neither). A last line without its newline (a write cut by a crash) is skipped; any other
    bad line is a RecordError naming the file and line."""
    out: list[dict[str, Any]] = []
    for file in recorded_files(where):
        text = file.read_text()
        lines = text.split("\n")
        complete = lines[:-1]  # the part after the last newline is "" or a line a crash cut
        trajectories, rewards = [], {}
        for number, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordError(f"{file}: line {number} is not JSON ({exc.msg})") from None
            kind = row.get("kind") if isinstance(row, dict) else None
            if kind == "reward":
                rewards[row["session"]] = float(row["reward"])
            elif kind == "trajectory":
                _check(row, f"{file}: line {number}")
                trajectories.append(row | {"where": f"{file.name}:{number}"})
            else:
                raise RecordError(f"{file}: line {number} has kind {kind!r}, not trajectory or reward")
        for row in trajectories:
            if row["reward"] is None:
                row["reward"] = rewards.get(row["session"])
        out += trajectories
    return out


def _check(row: dict[str, Any], where: str) -> None:
    if row.get("format") != FORMAT:
        raise RecordError(f"{where}: format {row.get('format')!r}; this hfrt reads format {FORMAT}")
    ids, mask, lps = row.get("response_ids"), row.get("gen_mask"), row.get("log_probs")
    if not row.get("prompt_ids") or not isinstance(ids, list) or not (len(ids) == len(mask or []) == len(lps or [])):
        raise RecordError(f"{where}: prompt_ids, and response_ids / gen_mask / log_probs of one length, are needed")
