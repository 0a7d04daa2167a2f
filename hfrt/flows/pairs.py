"""Preference pairs for reward-model training: a local JSONL / JSON / Parquet file of rows
`{"prompt": ..., "chosen": ..., "rejected": ..., "margin": optional number}`, checked row by row
before any daemon starts, a held-out split, and the seeded, reshuffled-per-epoch order in which a
step takes its pairs (fixed by seed and step, so a resumed run takes what the interrupted one would).

`prompt` is text or a chat (a list of {"role", "content"} messages); `chosen` / `rejected` are
the responses: text, or the assistant message(s) that follow a chat prompt. No torch, no roles:
the daemon tokenises. With no file, `addition_pairs` makes pairs for the built-in addition task
from its rule reward, as the RL flows fall back on the task's prompts.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfrt.flows.tasks import AdditionTask, addition_reward

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


class PairDataError(ValueError):
    """A preference file or row that cannot be trained on; the message names the file and row."""


def raw_rows(file: Path) -> list[Any]:
    """The rows of a .jsonl / .json (a list) / .parquet file as read, unchecked (PairDataError naming the file)."""
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise PairDataError(f"{file}: line {number}: not JSON ({exc.msg})") from None
        return rows
    if suffix == ".json":
        try:
            rows = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PairDataError(f"{file}: not JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(rows, list):
            raise PairDataError(f"{file}: a .json pair file must hold a list of rows")
        return rows
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PairDataError(f"{file}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        return list(pq.read_table(file).to_pylist())
    raise PairDataError(f"{file}: unknown pair file type {suffix!r}; use .jsonl, .json or .parquet")


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _text(value: Any, name: str, where: str) -> None:
    if isinstance(value, str):
        if not value.strip():
            raise PairDataError(f"{where}: `{name}` is empty")
    elif not _is_chat(value):
        raise PairDataError(f"{where}: `{name}` must be text or a list of {{role, content}} messages, not {value!r:.60}")


def check_pair(row: Any, where: str) -> dict[str, Any]:
    """One row checked: the three columns present and non-empty, chosen differs from rejected,
    a chat response only after a chat prompt, margin a number; returns its columns."""
    if not isinstance(row, Mapping):
        raise PairDataError(f"{where}: a row must be an object with {', '.join(PAIR_COLUMNS)}, not {type(row).__name__}")
    missing = [c for c in PAIR_COLUMNS if c not in row]
    if missing:
        raise PairDataError(f"{where}: missing column(s) {missing} (a pair row has {', '.join(PAIR_COLUMNS)}; it has {sorted(row)})")
    for name in PAIR_COLUMNS:
        _text(row[name], name, where)
    if row["chosen"] == row["rejected"]:
        raise PairDataError(f"{where}: `chosen` and `rejected` are identical ({row['chosen']!r:.60}): the pair prefers nothing")
    for side in ("chosen", "rejected"):
        if _is_chat(row[side]) and not _is_chat(row["prompt"]):
            raise PairDataError(f"{where}: `{side}` is a chat but `prompt` is text")
    margin = row.get("margin", 0.0)
    if margin is None:
        margin = 0.0
    if isinstance(margin, bool) or not isinstance(margin, int | float):
        raise PairDataError(f"{where}: `margin` must be a number, not {margin!r:.40}")
    return {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"], "margin": float(margin)}


def read_pairs(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a pair file, checked (PairDataError naming the file and row on the first bad one)."""
    file = Path(path)
    if not file.is_file():
        raise PairDataError(f"pair file {file} does not exist")
    rows = [check_pair(row, f"{file}: row {number}") for number, row in enumerate(raw_rows(file), start=1)]
    if not rows:
        raise PairDataError(f"{file}: no rows")
    for number, row in enumerate(rows, start=1):
        row["row"] = number
    return rows


def split_pairs(rows: list[dict[str, Any]], fraction: float, seed: int, noun: str = "pair") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): a seeded `fraction` of the rows held out (at least one row each)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = min(max(1, round(fraction * len(rows))), len(rows) - 1)
    if len(rows) < 2:
        raise PairDataError(f"{len(rows)} {noun}(s): holding some out for validation needs at least 2 (or set val_data)")
    return [rows[i] for i in sorted(order[held:])], [rows[i] for i in sorted(order[:held])]


def columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows as the non-tensor columns a daemon reads (prompt, chosen, rejected, margin, row)."""
    return {name: [r[name] for r in rows] for name in (*PAIR_COLUMNS, "margin", "row")}


def step_rows(rows: list[dict[str, Any]], step: int, per_step: int, seed: int) -> list[dict[str, Any]]:
    """Step `step`'s pairs: the stream of epochs, each a fresh seeded shuffle, cut in per_step pieces."""
    out: list[dict[str, Any]] = []
    position = step * per_step
    while len(out) < per_step:
        epoch, index = divmod(position, len(rows))
        order = list(range(len(rows)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        take = order[index : index + per_step - len(out)]
        out += [rows[i] for i in take]
        position += len(take)
    return out


# ------------------------------------------------------------------ the addition task's pairs

#: the tiny preset's EOS as text (its tokenizer reads it as the EOS token)
EOS = "</s>"
_OTHER = string.ascii_letters + string.punctuation + " "


def addition_response(rng: random.Random, truth: str) -> str:
    """One response in the form the `ppo` flow's actor produces (at most 2 tokens of the byte
    tokenizer): a digit (often the right one) and EOS, two characters (no EOS: cut at
    max_new_tokens), a non-digit and EOS or a digit, or EOS alone."""
    digit = truth if rng.random() < 0.35 else str(rng.randint(0, 9))
    form = rng.random()
    if form < 0.45:
        return digit + EOS
    if form < 0.75:
        return digit + rng.choice(string.digits + "=\n" + _OTHER)
    if form < 0.9:
        return rng.choice(_OTHER) + rng.choice([EOS, rng.choice(string.digits), rng.choice(_OTHER)])
    return EOS


def addition_pairs(count: int, seed: int, max_operand: int, margin: bool = False) -> list[dict[str, Any]]:
    """`count` pairs for the addition task: a prompt, two responses its rule reward
    (hfrt.flows.tasks.addition_reward) scores differently, the higher one `chosen` (with
    `margin`, the score difference as the pair's margin); numbered in `row` like a file's."""
    rng = random.Random(seed)
    task = AdditionTask(seed=seed, max_operand=max_operand)
    out: list[dict[str, Any]] = []
    while len(out) < count:
        prompts = task.batch(1)
        prompt, truth = prompts["prompt"][0], prompts["ground_truth"][0]
        a, b = addition_response(rng, truth), addition_response(rng, truth)
        score_a, score_b = (addition_reward(r.replace(EOS, ""), truth) for r in (a, b))
        if score_a == score_b:
            continue
        chosen, rejected = (a, b) if score_a > score_b else (b, a)
        row: dict[str, Any] = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        out.append(row | ({"margin": round(abs(score_a - score_b), 3)} if margin else {}))
    return out
