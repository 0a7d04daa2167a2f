"""Starting role daemons: the launcher interface, the local, SSH and Slurm launchers, and the
cluster + placement spec they read. Knows hfrt's daemon command line and where daemons go; knows
nothing of algorithms.
"""

from __future__ import annotations

from .base import DaemonSpec, Launcher, LaunchError, OnExit
from .local import LocalLauncher
from .placement import Placed, place
from .spec import ClusterSpec, SpecError, load_spec, parse_spec

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
