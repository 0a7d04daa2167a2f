"""Checkpoints carry a size and sha256 per saved file (state.json's "files"): a truncated or
altered weights file makes its checkpoint damaged, passed over for the previous whole one before
any daemon starts, like the other kinds of damage; a checkpoint from before checksums still loads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hfrt.flows.checkpoint import find_checkpoint, save_checkpoint


class SavingRole:
    """A role group's `save` endpoint as a daemon's engine runs it: a weights file of some size."""

    async def save(self, path: str, *, timeout_s: float) -> list[str]:
        Path(path).mkdir(parents=True)
        (Path(path) / "local.pt").write_bytes(bytes(range(256)) * 64)
        return [path]


def two_checkpoints(run_dir: Path) -> Path:
    for step in (2, 4):
        asyncio.run(save_checkpoint(run_dir, step, {"actor": SavingRole()}, {"data": {"position": step}}, timeout_s=5))
    return run_dir / "checkpoints" / "step_00000004"


def truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def flip_one_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[1000] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "message"), [
    (truncate, "actor/local.pt is 8192 bytes, it was 16384 when saved (truncated?)"),
    (flip_one_byte, "actor/local.pt does not match the sha256 it was saved with (damaged)"),
    (lambda f: f.unlink(), "role 'actor' has no saved files"),
])
def test_a_damaged_weights_file_falls_back_to_the_previous_checkpoint(tmp_path: Path, damage: object, message: str) -> None:
    newest = two_checkpoints(tmp_path)
    state = json.loads((newest / "state.json").read_text())
    assert state["files"]["actor/local.pt"][0] == 16384 and len(state["files"]["actor/local.pt"][1]) == 64
    damage(newest / "actor" / "local.pt")  # type: ignore[operator]
    found = find_checkpoint(tmp_path, max_step=10)
    assert found.checkpoint is not None and found.checkpoint.step == 2
    assert len(found.damaged) == 1 and found.damaged[0].startswith(f"checkpoint {newest}: {message}")


def test_a_checkpoint_without_checksums_is_taken_as_it_is(tmp_path: Path) -> None:
    newest = two_checkpoints(tmp_path)
    state = json.loads((newest / "state.json").read_text())
    del state["files"]
    (newest / "state.json").write_text(json.dumps(state))
    flip_one_byte(newest / "actor" / "local.pt")  # undetectable without checksums
    found = find_checkpoint(tmp_path, max_step=10)
    assert found.checkpoint is not None and found.checkpoint.step == 4 and not found.damaged
