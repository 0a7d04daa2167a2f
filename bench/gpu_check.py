"""The one-call GPU check's driver (bench/gpu/check.sh runs it): every part in its own process under
its own time box, in order, inside one overall budget; a part that fails or runs out of time is
recorded with its output's tail and the rest go on. Parts: env, models (random-weights Qwen3-0.6B
and Qwen3-1.7B built on the spot, bf16), gpu_tests (every `gpu`-marked test), ipc (CUDA IPC
bandwidth against a device-to-device copy: `hfrt bench transfer --device cuda`), transition (the
hybrid engine's train → generate switch and the memory sleep frees, on Qwen3-1.7B), grpo_vs_trl
(`hfrt bench vs-trl` with the HF engine on Qwen3-0.6B in bf16, interleaved with TRL). Each part's
peak device memory is sampled from outside (nvidia-smi). One JSON file is written.

Run: `python -m hfrt.bench.gpu_check [--cpu] [--out DIR] [--budget-s 470] [--parts a,b]`; --cpu runs
every part on the CPU with a tiny model of the same architecture (the check's own test). It knows
the parts' command lines and their outputs' last JSON line; nothing of what they measure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.bench.common import machine

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Part:
    """One step of the check: its name, the seconds it may take, and its command on a GPU / with --cpu."""

    name: str
    box_s: float
    gpu: list[str]
    cpu: list[str]


def parts(workdir: str) -> list[Part]:
    py, w = [sys.executable, "-m"], ["--workdir", workdir]
    gpu_part = [*py, "hfrt.bench.gpu_parts"]
    on_gpu, on_cpu = f"{workdir}/models/qwen3-0.6b", f"{workdir}/models/qwen3-tiny"
    vs_trl = [*py, "hfrt.bench.vs_trl", "--engine", "hf", "--json"]
    return [
        Part("env", 20, [*gpu_part, "env", *w], [*gpu_part, "env", *w, "--cpu"]),
        Part("models", 60, [*gpu_part, "models", *w], [*gpu_part, "models", *w, "--cpu"]),
        Part("gpu_tests", 100, [*py, "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()],
             [*py, "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()]),
        Part("ipc", 45, [*py, "hfrt.bench.transfer", "--device", "cuda", "--repeats", "5", "--sizes", "64MB", "512MB", "--json"],
             [*py, "hfrt.bench.transfer", "--device", "cpu", "--repeats", "1", "--sizes", "1MB", "--json"]),
        Part("transition", 60, [*gpu_part, "transition", *w], [*gpu_part, "transition", *w, "--cpu"]),
        Part("grpo_vs_trl", 150,
             [*vs_trl, "--model", on_gpu, "--dtype", "bfloat16", "--steps", "3", "--warmup", "1", "--prompts", "8", "--n", "4",
              "--max-new-tokens", "64"],
             [*vs_trl, "--model", on_cpu, "--steps", "1", "--warmup", "0", "--prompts", "2", "--n", "2", "--max-new-tokens", "4"]),
    ]


def gpu_test_files() -> list[str]:
    """Test files that hold a `gpu`-marked test (read, not imported: collecting the whole suite
    would import what a bare GPU machine lacks)."""
    marked = re.compile(r"pytest\.mark\.gpu|mark\.gpu\b")
    return sorted(str(f) for f in (ROOT / "tests").rglob("test_*.py") if marked.search(f.read_text(errors="replace")))


class DeviceMemory:
    """The device's used memory sampled every `interval_s` with nvidia-smi while a part runs:
    peak_mb over the part, baseline_mb before it (None without nvidia-smi)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.smi = shutil.which("nvidia-smi")
        self.interval_s = interval_s
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hfrt-gpu-check-memory", daemon=True)
        self.baseline_mb = self.used_mb()

    def used_mb(self) -> float | None:
        if self.smi is None:
            return None
        try:
            out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5, check=True).stdout
            return float(out.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            used = self.used_mb()
            if used is not None:
                self.peak_mb = max(self.peak_mb or 0.0, used)

    def __enter__(self) -> DeviceMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def last_json(text: str) -> dict[str, Any] | None:
    """The last stdout line that parses as a JSON object, if any."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def pytest_counts(text: str) -> dict[str, int]:
    """passed / skipped / failed / error counts from pytest's summary line."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", text)}


def run_part(part: Part, cmd: list[str], limit_s: float, env: dict[str, str]) -> dict[str, Any]:
    """One part in its own process group, killed at limit_s: status ok / failed / timeout, its
    seconds, its result (the last JSON line, or pytest's counts) or its output's tail."""
    start = time.perf_counter()
    with DeviceMemory() as memory:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=limit_s)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            status = "timeout"
    record: dict[str, Any] = {"status": status, "seconds": round(time.perf_counter() - start, 1), "limit_s": round(limit_s, 1),
                              "returncode": proc.returncode}
    if part.name == "gpu_tests":
        record["result"] = pytest_counts(out)
        if record["result"].get("failed") or record["result"].get("error") or record["result"].get("errors"):
            record["status"] = "failed" if status == "ok" else status
    else:
        record["result"] = last_json(out)
    if status != "ok" or record["result"] is None:
        record["output_tail"] = out[-3000:]
    if memory.peak_mb is not None:
        record |= {"device_used_before_mb": memory.baseline_mb, "device_peak_used_mb": memory.peak_mb}
    return record


def check(cpu: bool, budget_s: float, only: set[str] | None, workdir: str) -> dict[str, Any]:
    """Every part in order inside budget_s; a part gets min(its box, what is left)."""
    deadline = time.monotonic() + budget_s
    env = dict(os.environ, HFRT_CACHE=os.path.join(workdir, "cache"), TOKENIZERS_PARALLELISM="false")
    results: dict[str, Any] = {}
    for part in parts(workdir):
        if only is not None and part.name not in only:
            continue
        left = deadline - time.monotonic()
        if left < 5:
            results[part.name] = {"status": "skipped", "reason": f"out of time ({budget_s:.0f} s budget spent)"}
            continue
        print(f"[gpu-check] {part.name} (at most {min(part.box_s, left):.0f} s)", file=sys.stderr, flush=True)
        results[part.name] = run_part(part, part.cpu if cpu else part.gpu, min(part.box_s, left), env)
        print(f"[gpu-check] {part.name}: {results[part.name]['status']} in {results[part.name]['seconds']} s",
              file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="every part on the CPU with a tiny Qwen3 (the check's own test)")
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for the JSON file (default: $OUT, else here)")
    p.add_argument("--budget-s", type=float, default=470.0, help="seconds for all parts together")
    p.add_argument("--parts", default="", help="comma-separated parts to run (default: all)")
    p.add_argument("--workdir", default="", help="folder for models and caches (default: a temporary one, removed)")
    args = p.parse_args(argv)
    only = {x.strip() for x in args.parts.split(",") if x.strip()} or None
    start = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="hfrt-gpu-check-")
    try:
        results = check(args.cpu, args.budget_s, only, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    mode = "cpu" if args.cpu else "gpu"
    device = (results.get("env", {}).get("result") or {}).get("device", mode)
    report = {"check": "bench/gpu/check.sh", "mode": mode, "device": device, "budget_s": args.budget_s,
              "total_s": round(time.perf_counter() - start, 1), "parts": results,
              "failed": sorted(n for n, r in results.items() if r["status"] != "ok"), **machine()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^a-z0-9]+", "-", str(device).lower()).strip("-")
    path = Path(args.out) / f"gpu-check-{name}-{report['date']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[gpu-check] {len(results) - len(report['failed'])}/{len(results)} parts ok in {report['total_s']} s -> {path}",
          file=sys.stderr)
    print(json.dumps({"path": str(path), "failed": report["failed"], "total_s": report["total_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
