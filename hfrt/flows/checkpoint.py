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

Resuming: `latest` is followed only to a whole checkpoint (see check_checkpoint); a damaged one
is passed over for the newest whole `step_*` folder, and a run whose checkpoints are all damaged
is refused rather than restarted from step 0. Checksums: state.json's "files" lists every file the
roles saved with its size and sha256 (hashed on a worker thread after the save), and a checkpoint
whose files do not match (truncated, overwritten, bit rot) is damaged like any other; a
checkpoint written before checksums existed has no "files" and is taken as it is.

It knows role handles and file layout; what a role's state holds is the role's business.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
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


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be resumed from, naming the folder and what is wrong."""


_STEP_NAME = re.compile(r"step_(\d{8})")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


async def save_checkpoint(
    run_dir: str | Path, step: int, roles: Mapping[str, Any], state: dict[str, Any], *, timeout_s: float | None = None
) -> Path:
    """Have each role save itself under a staging folder (all at once), add state.json, rename the
    folder into place and point `latest` at it. `step` is the number of steps completed."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    staging = root / f".step_{step:08d}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    await asyncio.gather(*(group.save(str(staging / name), timeout_s=timeout_s) for name, group in roles.items()))
    files = await asyncio.to_thread(file_sums, staging)
    _write_atomic(staging / STATE_FILE, json.dumps({"step": step, "roles": sorted(roles), **state, "files": files}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    _write_atomic(root / "latest", final.name + "\n")
    _prune(root, keep=KEEP)
    return final


def latest_checkpoint(run_dir: str | Path, *, max_step: int | None = None) -> Checkpoint | None:
    """The newest whole checkpoint of a run (see find_checkpoint), or None when it has none."""
    return find_checkpoint(run_dir, max_step=max_step).checkpoint


@dataclass(frozen=True)
class Found:
    """The checkpoint a resume uses, and why each newer candidate was passed over."""

    checkpoint: Checkpoint | None
    damaged: list[str]


def find_checkpoint(run_dir: str | Path, *, max_step: int | None = None) -> Found:
    """The checkpoint `checkpoints/latest` names if it is whole, else the newest whole
    `step_*` folder; each damaged one passed over is described in `damaged`. Deterministic for
    a given folder, so the check before launch and the Trainer's resume pick the same one.
    `max_step` (the run's steps) makes a checkpoint beyond it damaged."""
    root = checkpoint_root(run_dir)
    damaged: list[str] = []
    candidates = sorted((p for p in root.glob("step_*") if _STEP_NAME.fullmatch(p.name)), reverse=True)
    pointer = root / "latest"
    if pointer.exists():
        named, problem = _pointed(root, pointer)
        if problem:
            damaged.append(problem)
        elif named is not None:
            candidates = [named] + [p for p in candidates if p.name != named.name]
    for path in candidates:
        try:
            return Found(check_checkpoint(path, max_step=max_step), damaged)
        except CheckpointError as exc:
            damaged.append(str(exc))
    return Found(None, damaged)


def resumable_checkpoint(run_dir: str | Path, *, max_step: int | None = None) -> Found:
    """find_checkpoint for a resume: raises CheckpointError, listing every problem, when the run
    has checkpoints but none of them is whole (starting over from step 0 would be a silent loss)."""
    found = find_checkpoint(run_dir, max_step=max_step)
    if found.checkpoint is None and found.damaged:
        raise CheckpointError(f"{run_dir}: no whole checkpoint to resume from: " + "; ".join(found.damaged))
    return found


def _pointed(root: Path, pointer: Path) -> tuple[Path | None, str]:
    """The folder `latest` names, or a problem when it names no checkpoint folder of this run."""
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{pointer}: unreadable ({exc})"
    if not _STEP_NAME.fullmatch(name):
        return None, f"{pointer} names {name[:80]!r}, which is not a checkpoint folder of this run (step_NNNNNNNN)"
    if not (root / name).is_dir():
        return None, f"{pointer} names {name}, which does not exist"
    return root / name, ""


def check_checkpoint(path: Path, *, max_step: int | None = None) -> Checkpoint:
    """A checkpoint folder read back and checked whole: state.json is an object whose `step`
    matches the folder's name (and is within `max_step`), whose `roles` each have a non-empty
    folder, and whose data / advantage / flow states are objects. Raises CheckpointError."""
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {STATE_FILE}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is not readable JSON ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} holds {type(state).__name__}, not an object")
    step = state.get("step")
    match = _STEP_NAME.fullmatch(path.name)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise CheckpointError(f"checkpoint {path}: step {step!r:.40} is not a positive integer")
    if match is not None and int(match.group(1)) != step:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} says step {step}, the folder's name says {int(match.group(1))}")
    if max_step is not None and step > max_step:
        raise CheckpointError(f"checkpoint {path}: step {step} is beyond this run's {max_step} steps")
    _check_parts(path, state)
    _check_files(path, state.get("files"))
    return Checkpoint(path, step, state)


def file_sums(folder: Path) -> dict[str, list[int | str]]:
    """Every file under `folder` but state.json: relative path → [bytes, sha256 hex]."""
    sums: dict[str, list[int | str]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != STATE_FILE:
            with path.open("rb") as f:
                sums[rel] = [path.stat().st_size, hashlib.file_digest(f, "sha256").hexdigest()]
    return sums


#: checkpoint folder → the (file, bytes, mtime) it was verified with: the check before launch and the
#: Trainer's resume run in one process, and a checkpoint's bytes are read once
_VERIFIED: dict[str, tuple[tuple[str, int, int], ...]] = {}


def _check_files(path: Path, files: Any) -> None:
    """The saved files match state.json's sizes and sha256 (None: a checkpoint from before checksums)."""
    if files is None:
        return
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and ".." not in Path(k).parts and not Path(k).is_absolute() and isinstance(v, list)
        and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str) for k, v in files.items()
    ):
        raise CheckpointError(f"checkpoint {path}: 'files' must map saved files to [bytes, sha256], got {files!r:.80}")
    seen = []
    for rel, (size, _) in sorted(files.items()):
        try:
            st = (path / rel).stat()
        except OSError:
            raise CheckpointError(f"checkpoint {path}: {rel} is missing (state.json lists it)") from None
        if st.st_size != size:
            raise CheckpointError(f"checkpoint {path}: {rel} is {st.st_size} bytes, it was {size} when saved (truncated?)")
        seen.append((rel, st.st_size, st.st_mtime_ns))
    if _VERIFIED.get(str(path)) == tuple(seen):
        return
    for rel, (_, digest) in sorted(files.items()):
        with (path / rel).open("rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                raise CheckpointError(f"checkpoint {path}: {rel} does not match the sha256 it was saved with (damaged)")
    _VERIFIED[str(path)] = tuple(seen)


def _check_parts(path: Path, state: dict[str, Any]) -> None:
    roles = state.get("roles")
    if not isinstance(roles, list) or not all(isinstance(r, str) and r and "/" not in r and r not in (".", "..") for r in roles):
        raise CheckpointError(f"checkpoint {path}: 'roles' must be a list of role names, got {roles!r:.80}")
    for role in roles:
        folder = path / role
        if not folder.is_dir() or not any(folder.iterdir()):
            raise CheckpointError(f"checkpoint {path}: role {role!r} has no saved files (expected {folder})")
    if not isinstance(state.get("data"), dict):
        raise CheckpointError(f"checkpoint {path}: 'data' (the data position) must be an object, got {state.get('data')!r:.80}")
    for key in ("advantage", "flow"):
        if key in state and not isinstance(state[key], dict):
            raise CheckpointError(f"checkpoint {path}: {key!r} must be an object, got {state[key]!r:.80}")


async def load_checkpoint(ckpt: Checkpoint, roles: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
    """Load every saved role's weights and optimizer state back into its daemons (all at once)."""
    missing = sorted(set(ckpt.state["roles"]) - set(roles))
    if missing:
        raise ValueError(f"checkpoint {ckpt.path} holds role(s) {missing} that this run does not have")
    await asyncio.gather(*(roles[name].load(str(ckpt.path / name), timeout_s=timeout_s) for name in ckpt.state["roles"]))


async def save_weights(folder: Path, roles: Mapping[str, Any], *, timeout_s: float | None = None) -> Path:
    """Have each role save itself under `folder/<role>` (replacing what was there), then write
    `folder/roles.json` last: a folder without it is not whole (a daemon's starting weights,
    which `reset_weights` loads back; see hfrt/flows/checkpoint_manager.py)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    await asyncio.gather(*(group.save(str(folder / name), timeout_s=timeout_s) for name, group in roles.items()))
    _write_atomic(folder / "roles.json", json.dumps(sorted(roles)))
    return folder


async def load_weights(folder: Path, roles: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
    """Load what save_weights wrote into every role of `roles`; CheckpointError when the folder
    is not whole or lacks one of them."""
    try:
        saved = set(json.loads((folder / "roles.json").read_text()))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: no whole set of saved weights ({exc})") from None
    missing = sorted(set(roles) - saved)
    if missing:
        raise CheckpointError(f"{folder}: holds no weights of role(s) {missing} (it has {sorted(saved)})")
    await asyncio.gather(*(group.load(str(folder / name), timeout_s=timeout_s) for name, group in roles.items()))


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
