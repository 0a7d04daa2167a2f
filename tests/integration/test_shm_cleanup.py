"""A daemon killed with SIGKILL leaves no tensor files in /dev/shm, without waiting for another
daemon to start on the host: the local launcher (which sees the exit), the controller (which sees
the death, for a daemon on its host) and the SSH launcher's node-side wrapper remove them. A live
daemon's files are never removed, nor those of a pid that is now another hfrt process."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from hfrt.deploy.launchers.base import DaemonSpec, expand
from hfrt.deploy.launchers.ssh import WRAPPER
from hfrt.protocols.signing import ENV_KEY
from hfrt.wire import shm
from tests.support import STARTED_PIDS, local_cluster, wait_for

pytestmark = pytest.mark.timeout(120)


def files_of(pid: int) -> list[Path]:
    return sorted(shm.SHM_DIR.glob(f"hfrt-{pid}-*"))


def probe(role: str = "p") -> list[DaemonSpec]:
    return expand(role, 1, "probe")


async def test_a_daemon_killed_with_sigkill_leaves_no_shm_files() -> None:
    async with local_cluster(probe()) as (ctl, launcher):
        p = await ctl.role("p")
        made = await p.make(list(range(8)))  # kept: its tensors stay in p's store, staged in /dev/shm
        pid = launcher.processes["p:0"].pid
        assert len(files_of(pid)) == len(made.keys()) > 0
        os.kill(pid, signal.SIGKILL)
        assert await wait_for(lambda: not files_of(pid), 10.0), f"left behind: {files_of(pid)}"
        assert not ctl.daemons("p")[0].alive


def start_bare_daemon(spec: DaemonSpec, ctl_address: str, key: bytes, heartbeat_s: float) -> subprocess.Popen[bytes]:
    """A daemon started without a launcher, so only the controller can clean up after it (and,
    never reaped until the test ends, it stays a zombie once killed)."""
    args = spec.daemon_args(ctl_address, heartbeat_s=heartbeat_s, orphan_timeout_s=30.0, log_level="warning")
    env = dict(os.environ, **{ENV_KEY: key.hex()})
    proc = subprocess.Popen([sys.executable, "-m", "hfrt", "daemon", *args], env=env, stdin=subprocess.DEVNULL)
    STARTED_PIDS.add(proc.pid)
    return proc


@asynccontextmanager
async def bare_probe_with_tensors() -> AsyncIterator[tuple[Any, subprocess.Popen[bytes]]]:
    """A controller and one probe daemon it did not launch, holding tensors in /dev/shm; the
    daemon is killed and its files removed on the way out."""
    from hfrt.control.controller import Controller
    from hfrt.protocols import new_key

    key = new_key()
    async with Controller("tcp://127.0.0.1:0", key, heartbeat_s=0.5) as ctl:
        proc = start_bare_daemon(probe()[0], ctl.address, key, 0.5)
        try:
            p = await ctl.role("p", timeout_s=60)
            await p.make(list(range(8)))
            yield ctl, proc
        finally:
            proc.kill()
            proc.wait()
            shm.remove_files_of(proc.pid)


async def test_the_controller_removes_the_files_of_a_daemon_it_saw_die() -> None:
    async with bare_probe_with_tensors() as (ctl, proc):
        assert files_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # a zombie now: nobody reaps it until the end
        assert await wait_for(lambda: not ctl.daemons("p")[0].alive, 30.0)
        assert not files_of(proc.pid), f"left behind: {files_of(proc.pid)}"


async def test_a_frozen_daemon_declared_gone_keeps_its_files() -> None:
    async with bare_probe_with_tensors() as (ctl, proc):
        before = files_of(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)  # alive, but silent: the controller declares it gone
        assert await wait_for(lambda: not ctl.daemons("p")[0].alive, 30.0)
        ctl.mark_gone("p:0", "again")  # any later report of its death still leaves a live daemon's files
        assert files_of(proc.pid) == before and before


def test_files_are_removed_only_when_their_pid_is_gone_or_not_hfrt(tmp_path: Path) -> None:
    """A pid reused by another program frees the dead daemon's files; a pid that is (again) an
    hfrt process, or this process, keeps them."""
    other = subprocess.Popen(["sleep", "60"])
    hfrt_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hfrt", "daemon"])
    zombie = subprocess.Popen(["true"])
    try:
        assert wait_for_sync(lambda: _state(zombie.pid) == "Z")
        pids = {"other": other.pid, "hfrt": hfrt_like.pid, "zombie": zombie.pid, "self": os.getpid()}
        made = {name: shm.path_for(pid, f"test-{name}") for name, pid in pids.items()}
        for path in made.values():
            path.write_bytes(b"x")
        removed = {name: shm.remove_files_of(pid) for name, pid in pids.items()}
        assert removed == {"other": 1, "hfrt": 0, "zombie": 1, "self": 0}
        assert shm.remove_files_of(other.pid, host="another-host") == 0
    finally:
        for proc in (other, hfrt_like, zombie):
            proc.kill()
            proc.wait()
        for pid in (other.pid, hfrt_like.pid, os.getpid()):
            for path in files_of(pid):
                if "-test-" in path.name:
                    path.unlink()


def wait_for_sync(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_the_ssh_wrapper_removes_the_files_of_a_daemon_that_was_killed(tmp_path: Path) -> None:
    """The node-side wrapper (run here under /bin/sh, no ssh needed) cleans up after its daemon:
    the stand-in daemon makes a tensor file named after its pid, then kills itself with SIGKILL."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    daemon = (
        "import os, signal; "
        "open(os.path.join(os.environ['HFRT_SHM_DIR'], f'hfrt-{os.getpid()}-t1'), 'w').close(); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    script = WRAPPER.format(
        log_dir=tmp_path, log=tmp_path / "daemon.log", workdir_cd=":",
        command=shlex.join([sys.executable, "-c", daemon]), started="hfrt-started", detach="detach",
    )
    proc = subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"key\nHFRT_SHM_DIR={shm_dir}\n\n".encode())
    proc.stdin.flush()
    started = proc.stdout.readline().split()
    code = proc.wait(timeout=60)
    proc.stdin.close()
    assert started[0] == b"hfrt-started" and code == 128 + signal.SIGKILL
    assert (tmp_path / "daemon.log").exists()
    assert list(shm_dir.iterdir()) == []
