"""What the launchers would run, checked without running it: ssh command lines, the node-side
wrapper, srun steps and the sbatch job script. Unit tests, no processes."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hfrt.deploy import ClusterSpec, parse_spec, place
from hfrt.deploy.cluster import advertised
from hfrt.deploy.launchers.slurm import SlurmLauncher
from hfrt.deploy.launchers.ssh import SshLauncher

pytestmark = pytest.mark.timeout(30)

SPEC = """
name = "t"
launcher = "{launcher}"
python = "/venv/bin/python"
env = {{ HF_TOKEN = "do-not-print" }}
[ssh]
user = "rl"
port = 2222
identity = "/keys/id"
strict_host_key_checking = "accept-new"
[slurm]
pin_nodes = {pin}
partition = "gpu"
sbatch_args = ["--gres=gpu:2"]
[[nodes]]
name = "a"
devices = 2
device_type = "cuda"
[[nodes]]
name = "b"
devices = 2
device_type = "cuda"
ssh_port = 2200
[roles.echo]
world_size = 4
cpus = 2
"""


def cluster(launcher: str, pin: bool = True) -> ClusterSpec:
    return parse_spec(tomllib.loads(SPEC.format(launcher=launcher, pin=str(pin).lower())), "t.toml")


def test_ssh_command_line_is_batch_mode_and_carries_no_secrets(tmp_path: Path) -> None:
    c = cluster("ssh")
    placed = place(c)
    launcher = SshLauncher(c, placed, log_dir=tmp_path, launch_id="L")
    argv = launcher.ssh_argv(placed[2].node)
    assert argv[:2] == ["ssh", "-T"] and argv[-1] == "b"
    assert "BatchMode=yes" in argv and "StrictHostKeyChecking=accept-new" in argv
    assert argv[argv.index("-p") + 1] == "2200" and argv[argv.index("-i") + 1] == "/keys/id"
    assert argv[argv.index("-l") + 1] == "rl"
    remote = launcher.remote_command(placed[2], "tcp://10.0.0.1:5555")
    assert remote.startswith("exec /bin/sh -c ")
    assert "/venv/bin/python -m hfrt daemon --role echo --rank 2 --world-size 4" in remote
    assert "do-not-print" not in remote and "HFRT_KEY=" not in remote
    assert "read -r HFRT_KEY" in remote, "the key is read from stdin on the node"


def test_srun_step_pins_node_device_and_cpus(tmp_path: Path) -> None:
    c = cluster("slurm")
    placed = place(c)
    launcher = SlurmLauncher(c, placed, run_dir=tmp_path, launch_id="L", key_file=tmp_path / "k", environ={"SLURM_JOB_ID": "77"})
    assert launcher.mode == "srun" and launcher.job_id == "77"
    argv = launcher.srun_argv(placed[3], "tcp://h:1")
    assert argv[:3] == ["srun", "--jobid=77", "--overlap"]
    assert "--nodelist=b" in argv and "--cpus-per-task=2" in argv
    assert argv[argv.index("env") + 1] == "CUDA_VISIBLE_DEVICES=1"
    assert "do-not-print" not in " ".join(argv)


def test_sbatch_script_maps_labels_onto_allocated_hosts(tmp_path: Path) -> None:
    c = cluster("slurm", pin=False)
    placed = place(c)
    launcher = SlurmLauncher(c, placed, run_dir=tmp_path, launch_id="L", key_file=tmp_path / "cluster.key", environ={})
    assert launcher.mode == "sbatch"
    script = launcher.job_script(placed, "tcp://login:5555")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --cpus-per-task=4" in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --gres=gpu:2" in script
    assert "--nodelist=" not in script.split("daemon()")[0], "unpinned: Slurm picks the hosts"
    line = next(x for x in script.splitlines() if x.startswith("daemon echo:3 "))
    assert '"${hosts[1]}"' in line and 'MASTER_ADDR="${hosts[0]}"' in line
    assert f"--key-file {tmp_path / 'cluster.key'}" in line and "CUDA_VISIBLE_DEVICES=1" in line


def test_sbatch_script_pins_named_nodes(tmp_path: Path) -> None:
    c = cluster("slurm", pin=True)
    launcher = SlurmLauncher(c, place(c), run_dir=tmp_path, launch_id="L", key_file=tmp_path / "k", environ={})
    script = launcher.job_script(place(c), "tcp://login:5555")
    assert "#SBATCH --nodelist=a,b" in script
    assert next(x for x in script.splitlines() if x.startswith("daemon echo:0 ")).split()[2] == "a"


def test_advertised_address_swaps_the_bound_host() -> None:
    assert advertised("tcp://0.0.0.0:41234", "10.0.0.5") == "tcp://10.0.0.5:41234"
