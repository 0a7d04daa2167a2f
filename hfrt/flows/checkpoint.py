"""Run checkpoints: RUN_DIR/checkpoints/step_NNNNNNNN/ holding one folder per trained role (each
written by that role's daemons through its `save` endpoint) and `state.json` (the step, the data
position, the flow's own state such as the KL controller or a Lagrange multiplier).

Atomic: everything is written into a `.partial` folder that is renamed into place only when whole,
then `checkpoints/latest` (a one-line file) is replaced with os.replace. A run killed at any moment
leaves either the previous checkpoint or the new one, never half of one. Daemons write to the
path the controller names, so on several hosts RUN_DIR must be on a shared filesystem.

RNG state: the controller's only generator is the data source's, saved as its position; the
built-in flows give every rollout an explicit seed derived from (seed, step), so a resumed run
samples what the interrupted one would have without saving the daemons' torch generators.

It knows role handles and file layout; what a role's state holds is the role's business.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
#: checkpoints kept besides the newest (older ones are deleted after a new one lands)
KEEP = 2


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


async def save_checkpoint(
    run_dir: str | Path, step: int, roles: Mapping[str, Any], state: dict[str, Any], *, timeout_s: float
) -> Path:
    """Have each role save itself under a staging folder (all at once), add state.json, rename the
    folder into place and point `latest` at it. `step` is the number of steps completed."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    staging = root / f".step_{step:08d}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    await asyncio.gather(*(group.save(str(staging / name), timeout_s=timeout_s) for name, group in roles.items()))
    _write_atomic(staging / STATE_FILE, json.dumps({"step": step, "roles": sorted(roles), **state}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    _write_atomic(root / "latest", final.name + "\n")
    _prune(root, keep=KEEP)
    return final


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The newest whole checkpoint of a run, or None when it has none."""
    root = checkpoint_root(run_dir)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    state_file = path / STATE_FILE
    if not state_file.exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which has no {STATE_FILE}")
    state = json.loads(state_file.read_text())
    return Checkpoint(path, int(state["step"]), state)


async def load_checkpoint(ckpt: Checkpoint, roles: Mapping[str, Any], *, timeout_s: float) -> None:
    """Load every saved role's weights and optimizer state back into its daemons (all at once)."""
    missing = sorted(set(ckpt.state["roles"]) - set(roles))
    if missing:
        raise ValueError(f"checkpoint {ckpt.path} holds role(s) {missing} that this run does not have")
    await asyncio.gather(*(roles[name].load(str(ckpt.path / name), timeout_s=timeout_s) for name in ckpt.state["roles"]))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[: -keep - 1] if keep >= 0 else []:
        shutil.rmtree(old, ignore_errors=True)
