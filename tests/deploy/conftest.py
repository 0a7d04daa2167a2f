"""Real services for the deploy tests: an sshd and a one-node Slurm cluster (munged, slurmctld,
slurmd) on 127.0.0.1, each started once per session in a temporary folder and stopped at the end.

When a service cannot run here (packages not installed, not root), the tests that need it skip
and say why. Daemons the tests start carry a per-test marker in their --options, so the `marker`
fixture can find them by command line and kill them by PID at teardown.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import STARTED_PIDS

SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def which(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def daemon_pids(marker: str) -> list[int]:
    """PIDs of live `python -m hfrt daemon` processes with `marker` in an argument (not the ssh,
    srun or shell processes whose command lines merely carry that command)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        is_python = Path(argv[0]).name.startswith("python")  # not srun/ssh/env carrying the command
        is_daemon = is_python and any(argv[i:i + 3] == ["-m", "hfrt", "daemon"] for i in range(len(argv)))
        if is_daemon and any(marker in a for a in argv) and state != "Z":
            found.append(int(entry))
    return found


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique string to put in a role's options; kills matching daemons left at teardown."""
    mark = f"hfrt-test-{secrets.token_hex(6)}"
    yield mark
    deadline = time.monotonic() + 10
    while daemon_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in daemon_pids(mark):
        STARTED_PIDS.add(pid)
        os.kill(pid, signal.SIGKILL)


# -- sshd -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sshd:
    port: int
    user: str
    identity: Path
    wrong_identity: Path
    known_hosts: Path


SSHD_CONFIG = """\
Port {port}
ListenAddress 127.0.0.1
HostKey {dir}/host_key
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
StrictModes no
MaxStartups 30:30:100
LogLevel ERROR
"""


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    missing = [n for n in ("sshd", "ssh", "ssh-keygen") if which(n) is None]
    if missing:
        pytest.skip(f"OpenSSH is not installed here (missing {', '.join(missing)}); .ci/run installs openssh-server")
    d = tmp_path_factory.mktemp("sshd")
    try:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    except OSError as exc:
        pytest.skip(f"cannot create /run/sshd for sshd: {exc.strerror}")
    for name in ("host_key", "user_key", "wrong_key"):
        subprocess.run([which("ssh-keygen") or "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(SSHD_CONFIG.format(port=port, dir=d))
    log = open(d / "sshd.log", "wb")
    proc = subprocess.Popen([which("sshd") or "sshd", "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=log)
    try:
        if not wait_port(port, 10):
            pytest.skip(f"sshd did not start: {(d / 'sshd.log').read_text()[-500:]}")
        import getpass

        yield Sshd(port, getpass.getuser(), d / "user_key", d / "wrong_key", d / "known_hosts")
    finally:
        stop_processes([proc])
        log.close()


# -- slurm ------------------------------------------------------------------------------------


SLURM_CONF = """\
ClusterName=hfrttest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
InactiveLimit=0
KillWait=2
MinJobAge=2
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "squeue", "scancel", "scontrol", "sinfo")


@dataclass(frozen=True)
class Slurm:
    node: str
    conf: Path


def _slurm_dirs(d: Path) -> None:
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)


def _slurm_idle(env: dict[str, str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env)
        state = (out.stdout + out.stderr).strip()
        if state == "idle":
            return ""
        time.sleep(0.2)
    return f"the node is {state!r}, not idle"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    missing = [n for n in SLURM_TOOLS if which(n) is None]
    if missing:
        pytest.skip(f"Slurm/munge are not installed here (missing {', '.join(missing)}); .ci/run installs them")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs with SlurmUser=root and needs root")
    d = tmp_path_factory.mktemp("slurm")
    _slurm_dirs(d)
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(node=node, dir=d, ctld_port=free_port(), slurmd_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": SBIN_PATH}
    log = open(d / "services.log", "wb")
    procs: list[subprocess.Popen[bytes]] = []
    saved = os.environ.get("SLURM_CONF")
    try:
        procs.append(subprocess.Popen([which("munged") or "munged", "-F", "-f", f"--socket={d}/munge/munge.sock",
                                       f"--key-file={d}/munge/munge.key", f"--pid-file={d}/munge/munged.pid",
                                       f"--seed-file={d}/munge/seed", f"--log-file={d}/munged.log"],
                                      stdout=log, stderr=log, env=env))
        time.sleep(0.3)
        procs.append(subprocess.Popen([which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)], stdout=log, stderr=log, env=env))
        time.sleep(0.5)
        procs.append(subprocess.Popen([which("slurmd") or "slurmd", "-D", "-f", str(conf)], stdout=log, stderr=log, env=env))
        problem = _slurm_idle(env, 30)
        if problem:
            pytest.skip(f"the test Slurm cluster did not come up ({problem}); see {d}/services.log")
        os.environ["SLURM_CONF"] = str(conf)
        yield Slurm(node, conf)
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        time.sleep(0.5)
        stop_processes(procs[::-1])
        log.close()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


def squeue_names(prefix: str) -> list[str]:
    """Names of jobs and steps in the test cluster whose name starts with prefix."""
    jobs = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout.split()
    steps = subprocess.run(["squeue", "-h", "-s", "-o", "%j"], capture_output=True, text=True).stdout.split()
    return [n for n in jobs + steps if n.startswith(prefix)]
