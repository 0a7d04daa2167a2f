"""Cluster spec validation and placement: unit tests, no processes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from hfrt.deploy import ClusterSpec, SpecError, load_spec, parse_spec, place

pytestmark = pytest.mark.timeout(30)

DEPLOY_DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"

TWO_NODES = """
launcher = "ssh"
[[nodes]]
name = "a"
address = "10.0.0.1"
devices = 4
device_type = "cuda"
[[nodes]]
name = "b"
address = "10.0.0.2"
devices = 4
device_type = "cuda"
"""


def spec(text: str) -> ClusterSpec:
    return parse_spec(tomllib.loads(text), "test.toml")


def problems(text: str) -> str:
    with pytest.raises(SpecError) as info:
        spec(text)
    return str(info.value)


def test_minimal_spec_puts_one_rank_per_device_in_the_default_pool() -> None:
    c = spec('[[nodes]]\nname = "localhost"\ndevices = 2\n[roles.echo]\n')
    assert c.launcher == "local" and list(c.pools) == ["all"]
    placed = place(c)
    assert [(p.identity, p.node.name, p.device) for p in placed] == [("echo:0", "localhost", 0), ("echo:1", "localhost", 1)]
    assert placed[1].spec.world_size == 2 and placed[1].spec.impl == "echo"


def test_colocated_roles_share_devices_rank_for_rank() -> None:
    roles = "".join(f'[roles.{r}]\nimpl = "echo"\nworld_size = 8\n' for r in ("actor", "critic", "reference", "reward"))
    placed = place(spec(TWO_NODES + roles))
    by_role: dict[str, list[tuple[str, int]]] = {}
    for p in placed:
        by_role.setdefault(p.spec.role, []).append((p.node.name, p.device))
    assert len(placed) == 32
    assert by_role["actor"] == by_role["critic"] == by_role["reference"] == by_role["reward"]
    actor5 = next(p for p in placed if p.identity == "actor:5")
    env = actor5.spec.env
    assert (actor5.node.name, actor5.device) == ("b", 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["RANK"] == "5" and env["WORLD_SIZE"] == "8"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "4" and env["MASTER_ADDR"] == "10.0.0.1"
    ports = {p.spec.role: p.spec.env["MASTER_PORT"] for p in placed}
    assert len(set(ports.values())) == 4, "each role group needs its own rendezvous port"


def test_split_placement_puts_pools_on_different_nodes() -> None:
    c = spec(TWO_NODES + """
[pools.train]
nodes = ["a"]
[pools.score]
nodes = ["b"]
[roles.actor]
impl = "echo"
pool = "train"
tp_size = 2
[roles.reference]
impl = "echo"
pool = "train"
[roles.critic]
impl = "echo"
pool = "score"
world_size = 2
""")
    placed = place(c)
    assert {p.node.name for p in placed if p.spec.role in ("actor", "reference")} == {"a"}
    critic = [p for p in placed if p.spec.role == "critic"]
    assert [(p.node.name, p.device) for p in critic] == [("b", 0), ("b", 1)]
    assert critic[0].spec.env["MASTER_ADDR"] == "10.0.0.2"
    actor = c.roles["actor"]
    assert (actor.world_size, actor.dp_size, actor.tp_size) == (4, 2, 2)
    actor1 = next(p for p in placed if p.identity == "actor:1")
    assert actor1.spec.dp_size == 2 and actor1.spec.options == {"parallel": {"tp": 2, "pp": 1}}
    assert "HFRT_TP_SIZE" not in actor1.spec.env and not critic[0].spec.options  # the layout travels as options


def test_one_pool_per_role_on_device_subsets() -> None:
    c = spec(TWO_NODES + """
[pools.gen]
nodes = ["a", "b"]
devices = [0, 1]
[pools.train]
nodes = ["a", "b"]
devices = [2, 3]
[roles.actor]
impl = "echo"
pool = "train"
[roles.rollout]
impl = "echo"
pool = "gen"
""")
    placed = place(c)
    assert [(p.node.name, p.device) for p in placed if p.spec.role == "actor"] == [("a", 2), ("a", 3), ("b", 2), ("b", 3)]
    assert [(p.node.name, p.device) for p in placed if p.spec.role == "rollout"] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_more_ranks_than_devices_is_refused_with_the_pool_size() -> None:
    text = problems(TWO_NODES + '[roles.actor]\nimpl = "echo"\nworld_size = 16\n')
    assert "role 'actor': 16 ranks but pool 'all' has 8 devices (a: 4, b: 4)" in text


def test_unknown_role_implementation_is_refused() -> None:
    text = problems(TWO_NODES + "[roles.actr]\nworld_size = 2\n")
    assert "unknown role 'actr': no built-in implementation 'actr' (built-in: " in text and "echo" in text
    assert spec(TWO_NODES + '[roles.actr]\nimpl = "my.module:Actor"\n').roles["actr"].impl == "my.module:Actor"


def test_roles_are_checked_against_the_flow() -> None:
    c = spec(TWO_NODES + '[roles.echo]\n[roles.extra]\nimpl = "echo"\n')
    c.check_roles(["echo", "extra"])
    with pytest.raises(SpecError, match="unknown role 'extra': flow 'ping' uses echo"):
        c.check_roles(["echo"], "flow 'ping'")
    with pytest.raises(SpecError, match="needs role 'critic', which the spec does not place"):
        c.check_roles(["echo", "extra", "critic"])


def test_overlapping_pools_must_be_marked_colocated() -> None:
    pools = TWO_NODES + """
[pools.x]
nodes = ["a"]
[pools.y]
nodes = ["a", "b"]
devices = [3]
{mark}
[roles.echo]
pool = "x"
"""
    text = problems(pools.format(mark=""))
    assert "pools 'x' and 'y' overlap on a:3" in text and "colocate_with" in text
    assert set(spec(pools.format(mark='colocate_with = ["x"]')).pools) == {"x", "y"}


def test_every_problem_is_reported_at_once() -> None:
    text = problems("""
launcher = "telnet"
[[nodes]]
name = "a"
devcies = 2
[roles.echo]
pool = "nope"
""")
    assert "launcher = 'telnet' is not one of local, ssh, slurm" in text
    assert "node 'a': devices must be >= 1 (got 0)" in text
    assert "[[nodes]] #1: unknown key 'devcies'" in text
    assert "role 'echo': unknown pool 'nope' (pools: all)" in text


@pytest.mark.parametrize(
    "role, message",
    [
        ("world_size = 8\ntp_size = 3", "world_size 8 is not a multiple of tp_size * pp_size = 3"),
        ("world_size = 8\ntp_size = 2\ndp_size = 3", "dp_size 3 * tp_size 2 * pp_size 1 = 6, not world_size 8"),
        ("world_size = 0", "parallel sizes must be >= 1"),
        ('world_size = "two"', "world_size must be int, got 'two'"),
        ("env = { 'BAD-NAME' = 'x' }", "'BAD-NAME' is not an environment variable name"),
    ],
)
def test_bad_role_settings(role: str, message: str) -> None:
    assert message in problems(TWO_NODES + f'[roles.actor]\nimpl = "echo"\n{role}\n')


def test_pool_devices_must_exist_and_local_launcher_must_stay_local() -> None:
    text = problems(TWO_NODES.replace('"ssh"', '"local"') + '[pools.p]\nnodes = ["a"]\ndevices = [7]\n[roles.echo]\n')
    assert "pool 'p': devices [7] do not exist on node 'a' (it has 0..3)" in text
    assert "launcher 'local' runs daemons on this machine, but nodes ['a', 'b'] name other hosts" in text


def test_files_that_cannot_be_read_or_parsed(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[nodes]\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(bad)


def test_user_env_stays_apart_from_the_rendezvous_env() -> None:
    c = spec('env = { HF_TOKEN = "secret" }\n' + TWO_NODES + '[roles.echo]\nworld_size = 1\nenv = { EXTRA = "1" }\n')
    p = place(c)[0]
    assert p.user_env()["HF_TOKEN"] == "secret" and p.user_env()["EXTRA"] == "1"
    assert "HF_TOKEN" not in p.rendezvous_env() and p.rendezvous_env()["RANK"] == "0"


def test_docs_cluster_examples_are_valid_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    import hfrt.roles as roles

    for name in ("actor", "critic", "reference", "reward"):  # the built-in role daemons
        monkeypatch.setitem(roles.BUILTIN, name, roles.BUILTIN.get(name, f"hfrt.roles.{name}:Daemon"))
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", DEPLOY_DOC.read_text(), re.S) if "[[nodes]]" in b]
    assert len(blocks) >= 2, "docs/deploy.md should show an SSH and a Slurm spec"
    launchers = set()
    for block in blocks:
        cluster = parse_spec(tomllib.loads(block), "docs/deploy.md")
        launchers.add(cluster.launcher)
        assert len(place(cluster)) == sum(r.world_size for r in cluster.roles.values())
    assert launchers == {"ssh", "slurm"}
