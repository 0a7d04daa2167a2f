"""Names of the tensor files daemons keep in /dev/shm (hfrt-PID-KEY), which host they are on, and
removing the files of a daemon that is gone.

Torch-free, so the controller and the launchers can clean up after a daemon killed with SIGKILL
(whose own clean-up never ran). It knows file names and /proc; nothing of the files' contents.
A file is removed only when the process its name carries is gone (no such pid, or a zombie) or
that pid now belongs to a process that is not hfrt (the pid was reused): a live daemon's files
are never touched.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path(os.environ.get("HFRT_SHM_DIR", "/dev/shm"))
PREFIX = "hfrt-"


def path_for(pid: int, key: str) -> Path:
    """The file holding tensor `key` of the daemon with process id `pid`."""
    return SHM_DIR / f"{PREFIX}{pid}-{key}"


@functools.cache
def host_id() -> str:
    """Same value ⇔ same kernel and same /dev/shm: boot id plus mount namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/mnt')}"
    except OSError:
        return socket.gethostname()


def owner_alive(pid: int) -> bool:
    """Whether files named after `pid` may still belong to a running hfrt process: the pid exists,
    is not a zombie, and its command line mentions hfrt (or it is this process). When /proc cannot
    tell (another user's process), the answer is yes: keep the files."""
    if pid == os.getpid():
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    state = stat.rsplit(")", 1)[-1].split()[:1]
    if state in (["Z"], ["X"]):
        return False
    return b"hfrt" in argv


def remove_files_of(pid: int, host: str | None = None) -> int:
    """Delete the tensor files of the daemon that had process id `pid`, if it is gone (see
    owner_alive); returns how many were removed. host: the daemon's host_id() (from its hello);
    when it is another host's, nothing here is its."""
    if (host is not None and host != host_id()) or owner_alive(pid):
        return 0
    return _unlink(SHM_DIR.glob(f"{PREFIX}{pid}-*"))


def remove_stale() -> int:
    """Delete the tensor files of every process that is gone (a daemon's start-up sweep)."""
    owners: dict[int, list[Path]] = {}
    for path in SHM_DIR.glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit():
            owners.setdefault(int(pid), []).append(path)
    return sum(_unlink(paths) for pid, paths in owners.items() if not owner_alive(pid))


def _unlink(paths: Iterable[Path]) -> int:
    removed = 0
    for path in paths:
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass  # already gone, or another user's file: not ours to remove
    return removed
