"""Placement: turn a validated ClusterSpec into one DaemonSpec per rank, each with its node and
device. It knows pools, ranks and the rendezvous environment; it does not start anything.

Rank r of a role takes slot r of its pool (slots run node by node, device by device), so
colocated roles share devices rank for rank, and tensor-parallel groups stay inside a node when
tp_size divides the devices per node. Each daemon's environment carries the torch.distributed
rendezvous of its role group (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: roles read it when no dist_master option is given), HFRT_NODE, HFRT_NODE_ADDR (the
node's address from the spec), HFRT_DEVICE, and CUDA_VISIBLE_DEVICES on cuda nodes. The
data-parallel size goes on the daemon's --dp-size; a tp_size or pp_size above 1 goes into the
daemon's options as `parallel` {tp, pp}, under what the role's own options.parallel sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.deploy.spec import ClusterSpec, Node, RolePlacement

#: Environment set by placement; never secret, so launchers may put it on a command line.
RENDEZVOUS_VARS = (
    "HFRT_NODE", "HFRT_NODE_ADDR", "HFRT_DEVICE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
)


@dataclass(frozen=True)
class Placed:
    """One daemon to start, the node it runs on, its device, and its role group's rank-0 node."""

    spec: DaemonSpec
    node: Node
    device: int
    master: Node

    @property
    def identity(self) -> str:
        return self.spec.identity

    def where(self) -> str:
        """How error messages name this daemon: role, rank, node and device."""
        host = f" ({self.node.host})" if self.node.host != self.node.name else ""
        return f"{self.spec.role}[{self.spec.rank}] on node {self.node.name}{host} device {self.device}"

    def rendezvous_env(self) -> dict[str, str]:
        return {k: v for k, v in self.spec.env.items() if k in RENDEZVOUS_VARS}

    def user_env(self) -> dict[str, str]:
        """Environment from the spec's env tables (may hold secrets: keep it off command lines)."""
        return {k: v for k, v in self.spec.env.items() if k not in RENDEZVOUS_VARS}


def place(cluster: ClusterSpec) -> list[Placed]:
    """Every daemon of every role, roles in spec order, ranks in order."""
    out: list[Placed] = []
    for index, role in enumerate(cluster.roles.values()):
        out += _place_role(cluster, role, cluster.daemons.master_port + index)
    return out


def _place_role(cluster: ClusterSpec, role: RolePlacement, port: int) -> list[Placed]:
    slots = cluster.pools[role.pool].slots[: role.world_size]
    master = cluster.node(slots[0][0])
    per_node: dict[str, int] = {}
    for node_name, _ in slots:
        per_node[node_name] = per_node.get(node_name, 0) + 1
    seen: dict[str, int] = {}
    placed = []
    for rank, (node_name, device) in enumerate(slots):
        node = cluster.node(node_name)
        local_rank = seen.get(node_name, 0)
        seen[node_name] = local_rank + 1
        env = {"OMP_NUM_THREADS": str(role.cpus), "MKL_NUM_THREADS": str(role.cpus), **cluster.env, **role.env}
        env.update({
            "HFRT_NODE": node.name, "HFRT_NODE_ADDR": node.address, "HFRT_DEVICE": str(device),
            "RANK": str(rank), "WORLD_SIZE": str(role.world_size),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(per_node[node_name]),
            "MASTER_ADDR": master.address, "MASTER_PORT": str(port),
        })
        if node.device_type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(device)
        spec = DaemonSpec(
            role.name, rank, role.world_size, role.impl, dp_size=role.dp_size, options=layout_options(role), env=env
        )
        placed.append(Placed(spec, node, device, master))
    return placed


def layout_options(role: RolePlacement) -> dict[str, Any]:
    """The role's options with its tp_size / pp_size as `parallel` {tp, pp} when either is above 1
    (what a tensor/pipeline-parallel role reads); a size the role's options.parallel sets wins."""
    options = dict(role.options)
    own = options.get("parallel")
    if role.tp_size * role.pp_size == 1 or not (own is None or isinstance(own, Mapping)):
        return options  # a malformed options.parallel is left for the role to refuse by name
    options["parallel"] = {"tp": role.tp_size, "pp": role.pp_size, **(own or {})}
    return options


def moved(placed: Placed, node: Node, device: int) -> Placed:
    """`placed` on another slot (a spare: hfrt.deploy.spec RolePlacement.spares): its node and
    device settings follow; a single-rank group's MASTER_ADDR follows too. Rank 0 of a larger
    group cannot move (the other ranks rendezvous at its node): ValueError."""
    spec = placed.spec
    if spec.world_size > 1 and spec.rank == 0:
        raise ValueError(f"{placed.where()}: rank 0 of a {spec.world_size}-rank group cannot move to a spare (its ranks meet there)")
    env = dict(spec.env)
    env.update({"HFRT_NODE": node.name, "HFRT_NODE_ADDR": node.address, "HFRT_DEVICE": str(device)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if node.device_type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    master = placed.master
    if spec.world_size == 1:
        env["MASTER_ADDR"], master = node.address, node
    new_spec = DaemonSpec(spec.role, spec.rank, spec.world_size, spec.impl, dp_size=spec.dp_size, options=dict(spec.options), env=env)
    return Placed(new_spec, node, device, master)
