"""Starting role daemons: the launcher interface, the local, SSH and Slurm launchers, and the
cluster + placement spec they read. Knows hfrt's daemon command line and where daemons go; knows
nothing of algorithms.
"""

from __future__ import annotations

from hfrt.deploy.launchers.base import DaemonSpec, Launcher, LaunchError, OnExit
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.deploy.placement import Placed, place
from hfrt.deploy.spec import ClusterSpec, SpecError, load_spec, parse_spec

__all__ = [
    "ClusterSpec",
    "DaemonSpec",
    "LaunchError",
    "Launcher",
    "LocalLauncher",
    "OnExit",
    "Placed",
    "SpecError",
    "load_spec",
    "parse_spec",
    "place",
]
