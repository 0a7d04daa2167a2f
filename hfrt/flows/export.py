"""The actor's export as a Hugging Face model folder at the end of a run (RUN_DIR/hf), owned by the
Trainer.

It knows the actor's `export_hf` endpoint and the folder's name; it does not know what the actor
writes there (the role's engine does) or when a run ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the export's folder under the run folder
FOLDER = "hf"


class HFExport:
    """Writes `actor` as a Hugging Face folder under `run_dir` (`enabled` false, no run folder or no
    actor: nothing)."""

    def __init__(self, run_dir: str, actor: Any, *, enabled: bool, timeout_s: float | None = None) -> None:
        self.folder = Path(run_dir) / FOLDER if run_dir and enabled and actor is not None else None
        self.actor, self.timeout_s = actor, timeout_s

    async def export(self) -> dict[str, str]:
        """Export, and return the summary's `hf_export` (the folder), or {} when there is nothing to do."""
        if self.folder is None:
            return {}
        await self.actor.export_hf(str(self.folder), timeout_s=self.timeout_s)
        return {"hf_export": str(self.folder)}
