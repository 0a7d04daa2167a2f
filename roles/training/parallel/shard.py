"""Kept for the training engine's import of the stage rule only (engines/tp.py, pipeline.py):
the rule lives in stages.py, and this module goes once those import it from there. It holds no
table of module names and knows nothing else.
"""

from __future__ import annotations

from hfrt.roles.training.parallel.stages import stage_layers, stage_of

__all__ = ["stage_layers", "stage_of"]
