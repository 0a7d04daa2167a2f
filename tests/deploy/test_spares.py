"""Spare slots in a cluster spec (`spares = [...]` on a role): parsing, checks, and a daemon
moved to one. Unit tests, no processes (the ssh test moves a real daemon)."""

from __future__ import annotations

import tomllib

import pytest

from hfrt.deploy import SpecError, parse_spec, place
from hfrt.deploy.placement import moved

pytestmark = pytest.mark.timeout(30)

NODES = """
launcher = "ssh"
[[nodes]]
name = "a"
address = "10.0.0.1"
devices = 2
device_type = "cuda"
[[nodes]]
name = "b"
address = "10.0.0.2"
devices = 2
device_type = "cuda"
[pools.main]
nodes = ["a"]
"""


def test_a_spare_names_a_node_or_one_of_its_devices_in_the_order_to_try() -> None:
    cluster = parse_spec(tomllib.loads(NODES + '[roles.reward]\nspares = ["b:1", "b", "a:0"]\n'), "t.toml")
    assert cluster.roles["reward"].spares == (("b", 1), ("b", 0), ("a", 0))
    assert parse_spec(tomllib.loads(NODES + "[roles.reward]\n"), "t.toml").roles["reward"].spares == ()


@pytest.mark.parametrize(("spares", "says"), [
    ('["c"]', "role 'reward': spare 'c' is not a node of the spec (nodes: a, b)"),
    ('["b:2"]', "role 'reward': spare 'b:2': node 'b' has devices 0..1"),
    ('["b:x"]', "role 'reward': spare 'b:x': node 'b' has devices 0..1"),
    ('"b"', "role 'reward': spares must be list"),
])
def test_a_bad_spare_is_refused_naming_the_role_and_the_slot(spares: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(tomllib.loads(NODES + f"[roles.reward]\nspares = {spares}\n"), "t.toml")
    assert says in str(info.value)


def test_a_daemon_moved_to_a_spare_takes_its_node_and_device_settings() -> None:
    cluster = parse_spec(tomllib.loads(NODES + '[roles.reward]\nworld_size = 1\nspares = ["b:1"]\n'), "t.toml")
    [placed] = place(cluster)
    spare = moved(placed, cluster.node("b"), 1)
    env = spare.spec.env
    assert (spare.node.name, spare.device, spare.master.name) == ("b", 1, "b")
    assert env["HFRT_NODE"] == "b" and env["HFRT_DEVICE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.2" and spare.identity == placed.identity == "reward:0"


def test_rank_zero_of_a_larger_group_cannot_move() -> None:
    cluster = parse_spec(tomllib.loads(NODES + '[roles.reward]\nworld_size = 2\nspares = ["b"]\n'), "t.toml")
    rank0, rank1 = place(cluster)
    with pytest.raises(ValueError, match=r"rank 0 of a 2-rank group cannot move"):
        moved(rank0, cluster.node("b"), 0)
    assert moved(rank1, cluster.node("b"), 0).spec.env["MASTER_ADDR"] == "10.0.0.1", "the group still meets at rank 0's node"
