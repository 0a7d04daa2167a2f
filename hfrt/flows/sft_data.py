"""Supervised fine-tuning rows: a local JSONL / JSON / Parquet file of rows in one of TRL's two SFT
formats, checked row by row before any daemon starts, and the addition task's demonstrations when
no file is given.

- prompt-completion: `{"prompt": ..., "completion": ...}` (`response` is accepted for
  `completion`): both text, or a chat prompt (messages) and the assistant message(s) answering it;
  the loss counts the completion.
- conversation: `{"messages": [{"role", "content"}, ...]}`: the loss counts every assistant turn.

No torch, no roles: the actor tokenises (with the model's chat template) and trains. The split and
each step's rows are those of the preference pairs (hfrt.flows.pairs): seeded, reshuffled per epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfrt.flows.pairs import PairDataError, raw_rows
from hfrt.flows.tasks import AdditionTask

#: the non-tensor columns an SFT batch carries (a row leaves the ones it does not use None)
SFT_COLUMNS = ("messages", "prompt", "completion", "row")


class SFTDataError(ValueError):
    """An SFT file or row that cannot be trained on; the message names the file and row."""


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _conversation(messages: Any, where: str) -> dict[str, Any]:
    if not _is_chat(messages):
        raise SFTDataError(f"{where}: `messages` must be a list of {{role, content}} messages, not {messages!r:.60}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise SFTDataError(f"{where}: the conversation has no assistant message to train on (roles {roles})")
    return {"messages": [dict(m) for m in messages]}


def _completion(prompt: Any, completion: Any, where: str) -> dict[str, Any]:
    if isinstance(prompt, str) and isinstance(completion, str):
        for name, text in (("prompt", prompt), ("completion", completion)):
            if not text.strip():
                raise SFTDataError(f"{where}: `{name}` is empty")
    elif _is_chat(prompt) and _is_chat(completion):
        if any(m["role"] != "assistant" for m in completion):
            raise SFTDataError(f"{where}: a chat `completion` holds the assistant's message(s) only (roles {[m['role'] for m in completion]})")
    else:
        raise SFTDataError(f"{where}: `prompt` and `completion` must both be text or both be lists of {{role, content}} messages")
    return {"prompt": prompt, "completion": completion}


def check_sft_row(row: Any, where: str) -> dict[str, Any]:
    """One row checked: a conversation (`messages`) or a prompt-completion row (`completion` or
    `response`); returns it with the columns the actor reads."""
    if not isinstance(row, Mapping):
        raise SFTDataError(f"{where}: a row must be an object with `messages`, or `prompt` and `completion`, not {type(row).__name__}")
    if row.get("messages") is not None:
        return _conversation(row["messages"], where)
    if "completion" in row and "response" in row:
        raise SFTDataError(f"{where}: both `completion` and `response`: give one")
    completion = row.get("completion", row.get("response"))
    if row.get("prompt") is None or completion is None:
        raise SFTDataError(f"{where}: an SFT row has `messages`, or `prompt` and `completion` (or `response`); it has {sorted(row)}")
    return _completion(row["prompt"], completion, where)


def read_sft_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of an SFT file, checked (SFTDataError naming the file and row on the first bad one),
    numbered from 1 in `row`."""
    file = Path(path)
    if not file.is_file():
        raise SFTDataError(f"SFT data file {file} does not exist")
    try:
        raw = raw_rows(file)
    except PairDataError as exc:
        raise SFTDataError(str(exc)) from None
    rows = [check_sft_row(row, f"{file}: row {number}") | {"row": number} for number, row in enumerate(raw, start=1)]
    if not rows:
        raise SFTDataError(f"{file}: no rows")
    return rows


def addition_demonstrations(count: int, seed: int, max_operand: int) -> list[dict[str, Any]]:
    """`count` prompt-completion rows of the built-in addition task: "3+4=" answered "7" (the actor
    ends it with EOS, as TRL does), numbered in `row` like a file's."""
    task = AdditionTask(seed=seed, max_operand=max_operand)
    batch = task.batch(count)
    return [{"prompt": p, "completion": t, "row": i + 1} for i, (p, t) in enumerate(zip(batch["prompt"], batch["ground_truth"], strict=True))]


def sft_columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows as the non-tensor columns the actor's sft endpoints read (SFT_COLUMNS; None where unused)."""
    return {name: [r.get(name) for r in rows] for name in SFT_COLUMNS}
