"""Transition benchmark: the actor's train → generate → train switch for each preset — the time
to push the trained weights into the generation engine and to release it again, and the peak
memory — beside one plain in-process copy of the same weights (the floor any push compares with).

Run: `hfrt bench transition [--presets tiny smollm2-135m] [--engine hf|vllm] [--repeats N]
[--no-daemon] [--json] [--out FILE]`. Each preset is measured in a fresh process
(bench/transition_measure.py), so its peak RSS is its own; unless --no-daemon, a real actor daemon per
preset also reports the transitions around its `generate` calls (P_daemon_*). With --json the
last stdout line is one JSON object with P_to_generate_s, P_to_train_s, P_weights_copy_s and
P_peak_rss_mb for every preset P that ran. It knows nothing of RL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine
from hfrt.control.controller import Controller
from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.log import configure as configure_logging
from hfrt.protocols import BatchHandle, new_key
from hfrt.protocols.handles import Shard
from hfrt.wire.loop import run

PRESETS = ("tiny", "smollm2-135m")
PROMPT = "Write one short sentence about the sea."


def prefix(preset: str, engine: str) -> str:
    """Key prefix: the preset with '-' → '_' (tiny, smollm2_135m), plus the engine unless hf."""
    name = preset.replace("-", "_").replace(".", "_")
    return name if engine == "hf" else f"{name}_{engine}"


def in_process(preset: str, engine: str, repeats: int) -> dict[str, float]:
    """transition_measure.measure_transition in a child process (its own memory), keys renamed."""
    code = (
        "import json, sys; from hfrt.bench.transition_measure import measure_transition; "
        f"print(json.dumps(measure_transition({preset!r}, engine={engine!r}, repeats={repeats})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {preset} ({engine}) failed:\n{done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    old, new = prefix(preset, "hf"), prefix(preset, engine)
    return {new + key[len(old):]: value for key, value in figures.items()}


def prompts_handle(texts: list[str]) -> BatchHandle:
    """A prompts batch made here: non-tensor columns only, read by the actor straight from the handle."""
    return BatchHandle((Shard("controller:0", len(texts), {}, {"prompt": texts}),))


async def through_daemon(preset: str, engine: str, repeats: int) -> dict[str, float]:
    """Transitions reported in the meta of a real actor daemon's `generate` calls (medians; peak max)."""
    key = new_key()
    options = {"model": preset, "generator": engine, "sampling": {"max_new_tokens": 4, "seed": 0}}
    if engine == "vllm":
        options["vllm"] = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20}
    async with Controller("tcp://127.0.0.1:0", key) as ctl:
        launcher = LocalLauncher(log_level="warning")
        await launcher.start([DaemonSpec("actor", impl="actor", options=options)], controller=ctl.address, key=key,
                             on_exit=ctl.mark_gone)
        try:
            actor = await ctl.role("actor", timeout_s=600)
            metas = [(await actor.generate(prompts_handle([PROMPT]))).meta for _ in range(repeats)]
        finally:
            await ctl.shutdown_daemons()
            await launcher.stop()
    p = prefix(preset, engine)
    return {
        f"{p}_daemon_to_generate_s": statistics.median(m["timing/reshard_to_generate_s"] for m in metas),
        f"{p}_daemon_to_train_s": statistics.median(m["timing/reshard_to_train_s"] for m in metas),
        f"{p}_daemon_peak_rss_mb": max(m["memory/peak_rss_mb"] for m in metas),
    }


def report(result: dict[str, Any], presets: list[str], engine: str) -> None:
    print(f"{'preset':<16}{'weights MB':>12}{'to_generate':>13}{'to_train':>11}{'plain copy':>12}{'ratio':>8}{'peak RSS MB':>13}")
    for preset in presets:
        p = prefix(preset, engine)
        if f"{p}_to_generate_s" not in result:
            continue
        ratio = result[f"{p}_to_generate_s"] / max(result[f"{p}_weights_copy_s"], 1e-9)
        print(f"{p:<16}{result[f'{p}_weights_mb']:>12.1f}{result[f'{p}_to_generate_s'] * 1e3:>11.2f}ms"
              f"{result[f'{p}_to_train_s'] * 1e3:>9.2f}ms{result[f'{p}_weights_copy_s'] * 1e3:>10.2f}ms"
              f"{ratio:>7.1f}×{result[f'{p}_peak_rss_mb']:>13.0f}")
        if f"{p}_daemon_to_generate_s" in result:
            print(f"{'  in a daemon':<16}{'':>12}{result[f'{p}_daemon_to_generate_s'] * 1e3:>11.2f}ms"
                  f"{result[f'{p}_daemon_to_train_s'] * 1e3:>9.2f}ms{'':>12}{'':>8}{result[f'{p}_daemon_peak_rss_mb']:>13.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench transition", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS), help="model presets to measure")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="generation engine behind the hybrid engine")
    p.add_argument("--repeats", type=int, default=5, help="round trips per preset (medians are reported)")
    p.add_argument("--no-daemon", action="store_true", help="skip the measurement through a real actor daemon")
    add_output_flags(p)
    args = p.parse_args(argv)
    configure_logging("warning")
    result: dict[str, Any] = {}
    for preset in args.presets:
        result |= in_process(preset, args.engine, args.repeats)
        if not args.no_daemon:
            result |= run(through_daemon(preset, args.engine, args.repeats))
    result = {k: round(v, 6) for k, v in result.items()} | {"engine": args.engine, "repeats": args.repeats} | machine()
    report(result, args.presets, args.engine)
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
