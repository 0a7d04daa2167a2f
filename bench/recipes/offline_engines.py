"""`sft` and `dpo` whole, as a user runs them, on every training engine they claim — local (the
reference), DeepSpeed ZeRO-3 on 2 ranks, the TP engine at tp=2 and at pp=2 — with the same rows,
steps and seed: each engine's held-out figures after two optimizer steps against the local run's,
and whether they agree at fp32 rounding (TOLERANCE). FSDP2 on two ranks is a CI test
(tests/integration/test_sft_dpo_flows.py); these runs take minutes (DeepSpeed's start-up most), so
they are a check here, not CI.

`python -m hfrt.bench.recipes.offline_engines [--out FILE]` prints one line a run and exits 1 when
an engine's figures differ from the local run's by more than TOLERANCE. It runs the CLI and reads
the flows' summaries; nothing of the daemons.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hfrt.bench.recipes.rm_recipe import controller

#: an engine's settings on top of the flow's defaults (every run: the tiny preset, 2 steps)
ENGINES: dict[str, tuple[str, ...]] = {
    "local": (),
    "deepspeed-zero3-2ranks": ("roles.actor.world_size=2", "roles.actor.options.engine.backend=deepspeed"),
    "tp2": ("roles.actor.world_size=2", "roles.actor.options.parallel.tp=2"),
    "pp2": ("roles.actor.world_size=2", "roles.actor.options.parallel.pp=2"),
}
#: each flow's settings and the held-out figures compared
FLOWS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sft": (("max_steps=2", "rows_per_step=16", "rows_count=200"), ("val_loss", "val_before_loss", "val_token_accuracy")),
    "dpo": (("max_steps=2", "pairs_per_step=16", "pairs_count=200"),
            ("val_loss", "val_before_loss", "val_rewards_margins", "val_rewards_chosen", "val_rewards_rejected",
             "val_logps_chosen", "val_logps_rejected")),
}
#: the largest difference from the local run's figures that counts as fp32 rounding (relative to
#: the figure's size, at least 1)
TOLERANCE = 1e-5
QUIET = ("tensorboard=false", "trace=false", "export_hf=false")


def run(flow: str, engine: str) -> dict[str, Any]:
    settings, _ = FLOWS[flow]
    args = ["--flow", flow]
    for item in (*settings, *ENGINES[engine], *QUIET):
        args += ["--set", item]
    return controller(*args)


def compare(flow: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each engine's largest difference from the local run over the flow's figures."""
    _, keys = FLOWS[flow]
    local = runs["local"]
    out: dict[str, Any] = {}
    for engine, summary in runs.items():
        worst = max(abs(summary[k] - local[k]) / max(1.0, abs(local[k])) for k in keys)
        out[engine] = {"figures": {k: summary[k] for k in keys}, "wall_s": summary["wall_s"],
                       "max_rel_diff_vs_local": worst, "equal_at_fp32": worst <= TOLERANCE}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    results: dict[str, Any] = {"tolerance": TOLERANCE, "flows": {}}
    for flow in FLOWS:
        runs = {}
        for engine in ENGINES:
            runs[engine] = run(flow, engine)
            print(f"{flow} on {engine}: val_loss {runs[engine]['val_loss']:.7f} ({runs[engine]['wall_s']} s)", flush=True)
        results["flows"][flow] = compare(flow, runs)
    results["all_equal_at_fp32"] = all(e["equal_at_fp32"] for f in results["flows"].values() for e in f.values())
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0 if results["all_equal_at_fp32"] else 1)


if __name__ == "__main__":
    main()
