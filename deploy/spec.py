"""The cluster + placement spec: nodes, resource pools and role placement, read from TOML and
validated up front. It knows hosts, devices and role names; it does not know how daemons are
started (launchers), what a role computes, or what a flow does with it.

A spec file looks like this (every key except nodes and roles is optional)::

    name = "two-node"
    launcher = "ssh"                      # local | ssh | slurm
    python = "/opt/venv/bin/python"       # on the nodes; default: this interpreter's path
    env = { HF_HOME = "/shared/hf" }      # extra environment for every daemon

    [controller]                          # where daemons find the controller
    host = "10.0.0.1"                     # advertised; default: this machine's route to the nodes
    port = 0                              # 0: any free port

    [ssh]
    user = "ubuntu"
    identity = "~/.ssh/id_ed25519"

    [[nodes]]
    name = "gpu-a"                        # label; also the ssh host / Slurm node name by default
    devices = 8
    device_type = "cuda"                  # cpu | cuda (cuda sets CUDA_VISIBLE_DEVICES per daemon)

    [pools.train]                         # default when no pools: one pool "all" of every device
    nodes = ["gpu-a"]

    [roles.actor]
    pool = "train"
    world_size = 8                        # default: dp_size * tp_size * pp_size
    tp_size = 2

Roles in one pool are colocated (they share its devices, rank r on the pool's device r). Two
different pools may not share a device unless one lists the other in `colocate_with`.
Placement (the DaemonSpecs and where each runs) is in `hfrt.deploy.placement`.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hfrt.deploy.reader import Reader, SpecError
from hfrt.protocols import check_heartbeat_s

LAUNCHERS = ("local", "ssh", "slurm")
DEVICE_TYPES = ("cpu", "cuda")
HOST_KEY_CHECKING = ("yes", "no", "accept-new")
SLURM_MODES = ("auto", "srun", "sbatch")
DEFAULT_POOL = "all"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Node:
    """One machine. host: where launchers reach it; address: where other daemons reach it."""

    name: str
    host: str
    address: str
    devices: int
    device_type: str = "cpu"
    ssh_user: str = ""
    ssh_port: int = 0
    ssh_identity: str = ""


@dataclass(frozen=True)
class Pool:
    """A named set of (node, device) slots, in order; roles placed on it share them."""

    name: str
    slots: tuple[tuple[str, int], ...]
    colocate_with: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RolePlacement:
    """One role group: where it runs and its parallel sizes (world = dp * tp * pp)."""

    name: str
    pool: str
    impl: str
    world_size: int
    dp_size: int
    tp_size: int = 1
    pp_size: int = 1
    cpus: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    #: (node, device) slots a daemon of this role moves to, in order, when its own slot fails to
    #: start it on a relaunch (hfrt.control.recovery, ssh launcher); `spares = ["node-c", "node-d:1"]`.
    spares: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ControllerSettings:
    """host: address daemons dial ("" = this machine's route to the first node); bind: the
    interface the controller listens on ("" = 127.0.0.1 when every node is this machine, else
    0.0.0.0); port: 0 picks a free one."""

    host: str = ""
    bind: str = ""
    port: int = 0


@dataclass(frozen=True)
class SshSettings:
    """Defaults for every node (a node's ssh_user/ssh_port/ssh_identity override them)."""

    user: str = ""
    port: int = 22
    identity: str = ""
    strict_host_key_checking: str = "yes"
    known_hosts: str = ""
    connect_timeout_s: float = 10.0
    options: tuple[str, ...] = ()
    max_parallel_per_node: int = 8


@dataclass(frozen=True)
class SlurmSettings:
    """mode: srun (steps in an allocation, made with salloc when not inside one), sbatch (a job
    script), or auto (srun inside an allocation, else sbatch). pin_nodes: pass node names as
    --nodelist; when false, node names are labels mapped onto whatever hosts Slurm allocates."""

    mode: str = "auto"
    partition: str = ""
    account: str = ""
    time: str = ""
    job_id: str = ""
    pin_nodes: bool = True
    sbatch_args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0


@dataclass(frozen=True)
class DaemonSettings:
    """How every daemon behaves: heartbeats, orphan exit, how long launch waits for hello, logs."""

    heartbeat_s: float = 2.0
    orphan_timeout_s: float = 60.0
    hello_timeout_s: float = 120.0
    log_level: str = "info"
    log_dir: str = "/tmp/hfrt-logs"
    master_port: int = 29500
    torch_threads: int = 1


@dataclass(frozen=True)
class ClusterSpec:
    """A whole validated spec. Build it with `load_spec` or `parse_spec`, never by hand."""

    name: str
    launcher: str
    python: str
    workdir: str
    env: dict[str, str]
    nodes: tuple[Node, ...]
    pools: dict[str, Pool]
    roles: dict[str, RolePlacement]
    controller: ControllerSettings = ControllerSettings()
    daemons: DaemonSettings = DaemonSettings()
    ssh: SshSettings = SshSettings()
    slurm: SlurmSettings = SlurmSettings()
    source: str = "<spec>"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def check_roles(self, wanted: Iterable[str], flow: str = "the flow") -> None:
        """Raise SpecError unless the spec places exactly the roles `flow` uses."""
        wanted = set(wanted)
        problems = [
            f"unknown role {r!r}: {flow} uses {', '.join(sorted(wanted)) or 'no roles'}"
            for r in sorted(set(self.roles) - wanted)
        ]
        problems += [f"{flow} needs role {r!r}, which the spec does not place" for r in sorted(wanted - set(self.roles))]
        if problems:
            raise SpecError(self.source, problems)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; an unreadable or invalid file is a SpecError naming it."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except OSError as exc:
        raise SpecError(str(p), [f"cannot read: {exc.strerror}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(p), [f"not valid TOML: {exc}"]) from None


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a TOML spec file."""
    return parse_spec(read_toml(path), str(path))


def parse_spec(data: dict[str, Any], source: str = "<spec>") -> ClusterSpec:
    """Validate a spec given as a dict (the parsed TOML); collects every problem before raising."""
    r = Reader(source)
    top = r.section(data, "top level", {
        "name", "launcher", "python", "workdir", "env", "controller", "daemons", "ssh", "slurm",
        "nodes", "pools", "roles",
    })
    nodes = _nodes(r, top.get("nodes"))
    pools = _pools(r, top.get("pools"), nodes)
    spec = ClusterSpec(
        name=r.get(top, "top level", "name", str, "hfrt"),
        launcher=r.choice(top, "top level", "launcher", LAUNCHERS, "local"),
        python=r.get(top, "top level", "python", str, sys.executable),
        workdir=r.get(top, "top level", "workdir", str, ""),
        env=_env(r, top.get("env", {}), "env"),
        nodes=nodes,
        pools=pools,
        roles=_roles(r, top.get("roles"), pools, nodes),
        controller=_controller(r, top.get("controller", {})),
        daemons=_daemons(r, top.get("daemons", {})),
        ssh=_ssh(r, top.get("ssh", {})),
        slurm=_slurm(r, top.get("slurm", {})),
        source=source,
    )
    _check_overlaps(r, pools)
    if spec.launcher == "local":
        far = [n.name for n in nodes if n.host not in LOCAL_HOSTS]
        if far:
            r.problem(f"launcher 'local' runs daemons on this machine, but nodes {far} name other hosts")
    r.raise_if_any()
    return spec


LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


# -- sections ---------------------------------------------------------------------------------


def _nodes(r: Reader, raw: Any) -> tuple[Node, ...]:
    if not isinstance(raw, list) or not raw:
        r.problem("no nodes: add at least one [[nodes]] table with name and devices")
        return ()
    nodes: list[Node] = []
    for i, item in enumerate(raw):
        where = f"[[nodes]] #{i + 1}"
        t = r.section(item, where, {"name", "host", "address", "devices", "device_type", "ssh_user", "ssh_port", "ssh_identity"})
        name = r.get(t, where, "name", str, "")
        if not name:
            r.problem(f"{where}: missing name")
            continue
        where = f"node {name!r}"
        host = r.get(t, where, "host", str, name)
        devices = r.get(t, where, "devices", int, 0)
        if devices < 1:
            r.problem(f"{where}: devices must be >= 1 (got {devices})")
        if any(n.name == name for n in nodes):
            r.problem(f"{where}: defined twice")
        nodes.append(Node(
            name, host, r.get(t, where, "address", str, host), devices,
            r.choice(t, where, "device_type", DEVICE_TYPES, "cpu"),
            r.get(t, where, "ssh_user", str, ""), r.get(t, where, "ssh_port", int, 0),
            r.get(t, where, "ssh_identity", str, ""),
        ))
    return tuple(nodes)


def _pools(r: Reader, raw: Any, nodes: tuple[Node, ...]) -> dict[str, Pool]:
    if raw is None:
        return {DEFAULT_POOL: Pool(DEFAULT_POOL, tuple((n.name, d) for n in nodes for d in range(n.devices)))}
    pools: dict[str, Pool] = {}
    by_name = {n.name: n for n in nodes}
    for name, item in r.section(raw, "[pools]", None).items():
        where = f"pool {name!r}"
        t = r.section(item, where, {"nodes", "devices", "colocate_with"})
        members = r.get(t, where, "nodes", list, [n.name for n in nodes])
        unknown = [m for m in members if m not in by_name]
        if unknown:
            r.problem(f"{where}: unknown nodes {unknown} (nodes: {', '.join(by_name)})")
        slots: list[tuple[str, int]] = []
        for node in (by_name[m] for m in members if m in by_name):
            wanted = r.get(t, where, "devices", list, list(range(node.devices)))
            bad = [d for d in wanted if not isinstance(d, int) or not 0 <= d < node.devices]
            if bad:
                r.problem(f"{where}: devices {bad} do not exist on node {node.name!r} (it has 0..{node.devices - 1})")
            slots += [(node.name, d) for d in dict.fromkeys(wanted) if d not in bad]
        if not slots:
            r.problem(f"{where}: has no devices")
        pools[name] = Pool(name, tuple(slots), frozenset(r.get(t, where, "colocate_with", list, [])))
    for pool in pools.values():
        for other in sorted(pool.colocate_with - set(pools)):
            r.problem(f"pool {pool.name!r}: colocate_with names unknown pool {other!r}")
    return pools


def _roles(r: Reader, raw: Any, pools: dict[str, Pool], nodes: tuple[Node, ...] = ()) -> dict[str, RolePlacement]:
    from hfrt.roles import BUILTIN

    if not isinstance(raw, dict) or not raw:
        r.problem("no roles: add a [roles.NAME] table per role (e.g. [roles.actor])")
        return {}
    roles: dict[str, RolePlacement] = {}
    for name, item in raw.items():
        where = f"role {name!r}"
        if not _NAME.match(name):
            r.problem(f"{where}: a role name is letters, digits, '_', '.', '-' (no ':')")
        t = r.section(item, where, {
            "pool", "impl", "world_size", "dp_size", "tp_size", "pp_size", "cpus", "options", "env", "spares",
        })
        impl = r.get(t, where, "impl", str, name)
        if impl not in BUILTIN and ":" not in impl:
            r.problem(
                f"unknown role {name!r}: no built-in implementation {impl!r} "
                f"(built-in: {', '.join(sorted(BUILTIN))}); set impl = \"module:Class\""
            )
        pool = _role_pool(r, t, where, pools)
        role = _sizes(r, t, where, name, pool, impl, pools)
        roles[name] = replace(role, spares=_spares(r, t, where, nodes))
    return roles


def _spares(r: Reader, t: dict[str, Any], where: str, nodes: tuple[Node, ...]) -> tuple[tuple[str, int], ...]:
    """A role's `spares`: "NODE" (each of its devices) or "NODE:DEVICE", in the order to try."""
    raw = r.get(t, where, "spares", list, [])
    by_name = {n.name: n for n in nodes}
    slots: list[tuple[str, int]] = []
    for item in raw:
        name, _, device = str(item).partition(":")
        node = by_name.get(name)
        if not isinstance(item, str) or node is None:
            r.problem(f"{where}: spare {item!r} is not a node of the spec (nodes: {', '.join(by_name)}); "
                      "write \"NODE\" or \"NODE:DEVICE\"")
        elif not device:
            slots += [(name, d) for d in range(node.devices)]
        elif not device.isdigit() or int(device) >= node.devices:
            r.problem(f"{where}: spare {item!r}: node {name!r} has devices 0..{node.devices - 1}")
        else:
            slots.append((name, int(device)))
    return tuple(dict.fromkeys(slots))


def _role_pool(r: Reader, t: dict[str, Any], where: str, pools: dict[str, Pool]) -> str:
    default = next(iter(pools)) if len(pools) == 1 else ""
    pool = r.get(t, where, "pool", str, default)
    if not pool:
        r.problem(f"{where}: several pools exist, set pool = one of {', '.join(pools)}")
    elif pool not in pools:
        r.problem(f"{where}: unknown pool {pool!r} (pools: {', '.join(pools)})")
    return pool


def _sizes(
    r: Reader, t: dict[str, Any], where: str, name: str, pool: str, impl: str, pools: dict[str, Pool]
) -> RolePlacement:
    tp, pp = r.get(t, where, "tp_size", int, 1), r.get(t, where, "pp_size", int, 1)
    dp = r.get(t, where, "dp_size", int, 0)
    room = len(pools[pool].slots) if pool in pools else 0
    world = r.get(t, where, "world_size", int, dp * tp * pp if dp else room)
    if min(tp, pp, world) < 1 or dp < 0:
        r.problem(f"{where}: parallel sizes must be >= 1")
        return RolePlacement(name, pool, impl, 1, 1)
    if world % (tp * pp):
        r.problem(f"{where}: world_size {world} is not a multiple of tp_size * pp_size = {tp * pp}")
    elif dp and dp * tp * pp != world:
        r.problem(f"{where}: dp_size {dp} * tp_size {tp} * pp_size {pp} = {dp * tp * pp}, not world_size {world}")
    dp = dp or max(1, world // (tp * pp))
    if pool in pools and world > room:
        per_node = _per_node(pools[pool])
        r.problem(f"{where}: {world} ranks but pool {pool!r} has {room} devices ({per_node})")
    cpus = r.get(t, where, "cpus", int, 1)
    options = dict(r.get(t, where, "options", dict, {}))
    return RolePlacement(name, pool, impl, world, dp, tp, pp, cpus, options, _env(r, t.get("env", {}), f"{where} env"))


def _per_node(pool: Pool) -> str:
    counts: dict[str, int] = {}
    for node, _ in pool.slots:
        counts[node] = counts.get(node, 0) + 1
    return ", ".join(f"{n}: {c}" for n, c in counts.items())


def _check_overlaps(r: Reader, pools: dict[str, Pool]) -> None:
    names = sorted(pools)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = set(pools[a].slots) & set(pools[b].slots)
            if shared and b not in pools[a].colocate_with and a not in pools[b].colocate_with:
                where = ", ".join(f"{n}:{d}" for n, d in sorted(shared)[:4]) + (" ..." if len(shared) > 4 else "")
                r.problem(
                    f"pools {a!r} and {b!r} overlap on {where}: put those roles in one pool to colocate them, "
                    f"or add colocate_with = [\"{b}\"] to pool {a!r} if sharing is intended"
                )


def _controller(r: Reader, raw: Any) -> ControllerSettings:
    t = r.section(raw, "[controller]", {"host", "bind", "port"})
    port = r.get(t, "[controller]", "port", int, 0)
    if not 0 <= port < 65536:
        r.problem(f"[controller]: port {port} is out of range")
    return ControllerSettings(r.get(t, "[controller]", "host", str, ""), r.get(t, "[controller]", "bind", str, ""), port)


def _daemons(r: Reader, raw: Any) -> DaemonSettings:
    w = "[daemons]"
    t = r.section(raw, w, {"heartbeat_s", "orphan_timeout_s", "hello_timeout_s", "log_level", "log_dir", "master_port", "torch_threads"})
    d = DaemonSettings()
    out = DaemonSettings(
        r.get(t, w, "heartbeat_s", float, d.heartbeat_s), r.get(t, w, "orphan_timeout_s", float, d.orphan_timeout_s),
        r.get(t, w, "hello_timeout_s", float, d.hello_timeout_s), r.get(t, w, "log_level", str, d.log_level),
        r.get(t, w, "log_dir", str, d.log_dir), r.get(t, w, "master_port", int, d.master_port),
        r.get(t, w, "torch_threads", int, d.torch_threads),
    )
    try:
        check_heartbeat_s(out.heartbeat_s, f"{w} heartbeat_s")
    except ValueError as exc:
        r.problem(str(exc))
    if out.hello_timeout_s <= 0:
        r.problem(f"{w}: hello_timeout_s must be > 0")
    return out


def _ssh(r: Reader, raw: Any) -> SshSettings:
    w = "[ssh]"
    t = r.section(raw, w, {
        "user", "port", "identity", "strict_host_key_checking", "known_hosts", "connect_timeout_s", "options",
        "max_parallel_per_node",
    })
    d = SshSettings()
    return SshSettings(
        r.get(t, w, "user", str, d.user), r.get(t, w, "port", int, d.port), r.get(t, w, "identity", str, d.identity),
        r.choice(t, w, "strict_host_key_checking", HOST_KEY_CHECKING, d.strict_host_key_checking),
        r.get(t, w, "known_hosts", str, d.known_hosts), r.get(t, w, "connect_timeout_s", float, d.connect_timeout_s),
        tuple(r.get(t, w, "options", list, [])), max(1, r.get(t, w, "max_parallel_per_node", int, d.max_parallel_per_node)),
    )


def _slurm(r: Reader, raw: Any) -> SlurmSettings:
    w = "[slurm]"
    t = r.section(raw, w, {
        "mode", "partition", "account", "time", "job_id", "pin_nodes", "sbatch_args", "srun_args", "start_timeout_s",
    })
    d = SlurmSettings()
    return SlurmSettings(
        r.choice(t, w, "mode", SLURM_MODES, d.mode), r.get(t, w, "partition", str, ""), r.get(t, w, "account", str, ""),
        r.get(t, w, "time", str, ""), str(r.get(t, w, "job_id", (str, int), "")), r.get(t, w, "pin_nodes", bool, True),
        tuple(r.get(t, w, "sbatch_args", list, [])), tuple(r.get(t, w, "srun_args", list, [])),
        r.get(t, w, "start_timeout_s", float, d.start_timeout_s),
    )


def _env(r: Reader, raw: Any, where: str) -> dict[str, str]:
    if not isinstance(raw, dict):
        r.problem(f"{where}: must be a table of NAME = \"value\"")
        return {}
    out: dict[str, str] = {}
    for key, value in raw.items():
        if not _ENV_NAME.match(key):
            r.problem(f"{where}: {key!r} is not an environment variable name")
        elif not isinstance(value, (str, int, float)) or "\n" in str(value):
            r.problem(f"{where}: {key} must be a one-line string")
        else:
            out[key] = str(value)
    return out
