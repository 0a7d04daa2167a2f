"""Starting role daemons: the launcher interface, the local, SSH and Slurm launchers (launchers/),
the cluster + placement spec they read, and `hfrt plan` (plan/). This face is what hfrt.session
uses. Knows hfrt's daemon command line and where daemons go; knows nothing of algorithms or of the
controller. May import protocols and hfrt.log; never hfrt.control.
"""

from __future__ import annotations

from hfrt.deploy import cluster
from hfrt.deploy.launchers.base import DaemonSpec, Launcher, LaunchError, OnExit, expand
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.deploy.launchers.proc import run_command
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
    "cluster",
    "expand",
    "cluster",
    "expand",
    "load_spec",
    "parse_spec",
    "place",
    "run_command",
    "run_command",
]
