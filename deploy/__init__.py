"""Starting role daemons: the launcher interface and its implementations (local processes now;
SSH and Slurm slot in behind the same interface). Knows hfrt's daemon command line; knows nothing
of algorithms.
"""

from __future__ import annotations

from .base import DaemonSpec, Launcher, OnExit
from .local import LocalLauncher

__all__ = ["DaemonSpec", "Launcher", "LocalLauncher", "OnExit"]
