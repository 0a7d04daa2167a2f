"""`hfrt plan`: the HybridFlow paper's Algorithm 1 (auto device mapping) — cost model, search, PLAN.toml, spec writing, calibration.
Pure arithmetic over specs and flows' STAGES: imports hfrt.flows (to read STAGES) and deploy/spec; no torch, no controller.
"""

from __future__ import annotations

from hfrt.deploy.plan.cli import add_arguments, main

__all__ = ["add_arguments", "main"]
