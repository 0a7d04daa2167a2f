"""A cluster spec with the local launcher: the same launch/rendezvous path as SSH and Slurm, with
plain subprocesses, so it runs everywhere (no Debian packages needed)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hfrt.deploy import ClusterSpec, LaunchError, parse_spec
from hfrt.flows import load_flow
from hfrt.session import run_on_cluster
from tests.deploy.conftest import daemon_pids

pytestmark = pytest.mark.timeout(60)


def local_spec(marker: str, impl: str = "echo") -> ClusterSpec:
    text = f"""
name = "{marker}"
[daemons]
hello_timeout_s = 30
[[nodes]]
name = "localhost"
devices = 2
[roles.echo]
impl = "{impl}"
options = {{ marker = "{marker}" }}
"""
    return parse_spec(tomllib.loads(text), "local.toml")


async def test_ping_flow_on_a_local_spec(tmp_path: Path, marker: str) -> None:
    summary = await run_on_cluster(load_flow("ping"), local_spec(marker), run_dir=tmp_path, config={"rounds": 10})
    assert len(summary["daemons"]) == 2 and summary["split_rows"][0] == [0, 0]
    assert daemon_pids(marker) == []


async def test_local_daemon_crashing_at_start_up_names_node_and_role(tmp_path: Path, marker: str) -> None:
    with pytest.raises(LaunchError, match=r"daemon echo:\d exited before saying hello") as info:
        await run_on_cluster(load_flow("ping"), local_spec(marker, "nonexistent.module:Nope"), run_dir=tmp_path, config={})
    assert "exited with code 2" in str(info.value) and "No module named 'nonexistent'" in str(info.value)
    assert daemon_pids(marker) == []
