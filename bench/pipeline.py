"""Pipeline and parallel-engine benchmark: the peak activation memory and step time of a training
step under the GPipe, 1F1B and interleaved 1F1B schedules (pp=2, the same micro-batches; interleaved
with 2 stages per rank), and the median step time of the
tp × pp × dp engine at several layouts, optionally beside another checkout of hfrt measured in the
same run (`--baseline-tree`, e.g. the commit before the engine moved onto torch's parallelism).

Run: `hfrt bench pipeline [--micro-batches 8] [--schedules gpipe 1f1b interleaved-1f1b]
[--layouts t2p1d1 t1p2d1 t1p1d2 t1p2d1v2] [--steps 5] [--baseline-tree DIR] [--sequence-parallel]
[--json] [--out FILE]` (`--sequence-parallel`: also t2p1d1 with and without engine.sequence_parallel,
its activations and step time side by side; `--schedules` / `--layouts` may then be left empty)
(a layout's `v2`: interleaved 1F1B with 2 stages per pipeline rank). Every measurement starts its own ranks (one process
each, gloo on CPU, NCCL with CUDA) running a random Llama-shaped model built in code; rank
processes import hfrt from the tree given (PYTHONPATH), so a baseline tree needs `hfrt/roles`,
`hfrt/protocols`, ... reachable as packages (see --help). Peak memory is reported two ways, the
maximum over ranks: the most bytes of tensors autograd held for backward at once during the step
(counted through saved-tensor hooks: exact, and what the schedule changes) and the largest rise
of resident memory (CUDA: allocated memory) over the step, sampled every 2 ms (on CPU the
allocator keeps freed memory, so this understates activations).
It knows nothing of RL beyond one PPO loss.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine

#: what one rank runs: build the engine, time `steps` PPO steps, sample peak memory of each
WORKER = r"""
import json, os, resource, threading, time
import torch, torch.distributed as dist
args = json.loads(os.environ["HFRT_BENCH_ARGS"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world,
                        init_method=f"tcp://127.0.0.1:{args['port']}")
if torch.cuda.is_available():
    torch.cuda.set_device(rank % torch.cuda.device_count())
from transformers import AutoModelForCausalLM, LlamaConfig
from hfrt.roles.losses import PolicyLossConfig, policy_loss
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
cfg = LlamaConfig(vocab_size=512, hidden_size=args["hidden"], intermediate_size=4 * args["hidden"],
                  num_hidden_layers=args["layers"], num_attention_heads=8, num_key_value_heads=4)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
extra = {"pp_schedule": args["schedule"]} if "pp_schedule" in EngineConfig.__dataclass_fields__ else {}
if args.get("virtual", 1) > 1:
    extra["pp_stages_per_rank"] = args["virtual"]
if args.get("sequence_parallel"):
    extra["sequence_parallel"] = True
engine = build_train_engine(model, EngineConfig(backend="tp", tp=args["tp"], pp=args["pp"],
                            micro_batch_size=args["micro_batch_size"], optim=OptimConfig(lr=1e-5), **extra))
rows, length, width = args["rows"] // engine.dp_size, args["seq"], args["seq"] // 2
g = torch.Generator().manual_seed(engine.dp_rank)
ids = torch.randint(3, 512, (rows, length), generator=g)
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, -width:],
         "response_mask": torch.ones(rows, width, dtype=torch.long),
         "advantages": torch.randn(rows, width, generator=g), "old_log_probs": torch.full((rows, width), -6.0)}
conf = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, agg_mode="token-mean")
def loss(out, mb, scale):
    return policy_loss(out.log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"], conf, scale)
def used():
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**20
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
held = [0, 0]  # bytes saved for backward now, and their peak over the step
class Saved:
    def __init__(self, t):
        local = getattr(t, "_local_tensor", t)  # a DTensor: this rank's piece
        self.t, self.n = t, local.numel() * local.element_size()
        held[0] += self.n; held[1] = max(held[1], held[0])
    def __del__(self):
        held[0] -= self.n
times, peaks, saved = [], [], []
for step in range(args["steps"] + 1):
    base, peak, stop = used(), [0.0], threading.Event()
    held[1] = held[0]
    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], used())
    t = threading.Thread(target=sample, daemon=True); t.start()
    dist.barrier(); start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.t):
        engine.step(loss, batch)
    dist.barrier(); elapsed = time.perf_counter() - start
    stop.set(); t.join(); peak[0] = max(peak[0], used())
    if step:  # the first step warms up (allocator, optimizer state)
        times.append(elapsed); peaks.append(peak[0] - base); saved.append(held[1] / 2**20)
box = [None] * world
dist.all_gather_object(box, {"times": times, "peaks": peaks, "saved": saved})
if rank == 0:
    print("RESULT " + json.dumps(box))
dist.barrier(); dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(settings: dict[str, Any], tree: str | None) -> dict[str, Any]:
    """One measurement in tp·pp·dp fresh rank processes; their step times and memory peaks."""
    world = settings["tp"] * settings["pp"] * settings["dp"]
    port = free_port()
    env = dict(os.environ, WORLD_SIZE=str(world), HFRT_BENCH_ARGS=json.dumps({**settings, "port": port}))
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        for r in range(world)
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a rank failed ({settings}):\n{err[-3000:]}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    ranks = json.loads(line[len("RESULT ") :])
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"])))
    peak = max(statistics.median(r["peaks"]) for r in ranks)
    saved = max(statistics.median(r["saved"]) for r in ranks)
    return {"step_s": round(step_s, 4), "peak_rss_rise_mb": round(peak, 1), "peak_saved_for_backward_mb": round(saved, 1)}


#: the schedules the memory comparison runs (interleaved: 2 stages per pipeline rank)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def parse_layout(text: str) -> tuple[int, int, int, int]:
    """'t1p2d1' → (1, 2, 1, 1); 't1p2d1v2' → (1, 2, 1, 2): interleaved 1F1B, 2 stages per rank."""
    import re

    match = re.fullmatch(r"t(\d+)p(\d+)d(\d+)(?:v(\d+))?", text)
    if not match:
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected t<tp>p<pp>d<dp>[v<stages per rank>], e.g. t2p1d1")
    tp, pp, dp = (int(g) for g in match.groups()[:3])
    return tp, pp, dp, int(match.group(4) or 1)


def schedule_settings(schedule: str, micro_batches: int) -> dict[str, Any]:
    """pp=2 with `micro_batches` micro-batches of 2 rows under `schedule`."""
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    return {"tp": 1, "pp": 2, "dp": 1, "schedule": schedule, "virtual": virtual, "rows": 2 * micro_batches, "micro_batch_size": 2}


def sequence_parallel(common: dict[str, Any], micro_batches: int) -> dict[str, Any]:
    """t2p1d1 with `micro_batches` micro-batches of 2 rows, sequence parallelism off and on."""
    base = common | {"tp": 2, "pp": 1, "dp": 1, "schedule": "1f1b", "rows": 2 * micro_batches, "micro_batch_size": 2}
    out: dict[str, Any] = {"layout": "t2p1d1"}
    for name, on in (("off", False), ("on", True)):
        out[name] = measure(base | {"sequence_parallel": on}, None)
        print(f"t2p1d1 sequence_parallel {name}: {json.dumps(out[name])}", flush=True)
    out["saved_ratio_on_vs_off"] = round(out["on"]["peak_saved_for_backward_mb"] / max(out["off"]["peak_saved_for_backward_mb"], 1e-9), 3)
    out["step_ratio_on_vs_off"] = round(out["on"]["step_s"] / out["off"]["step_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hfrt bench pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step in the memory comparison")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row (half of them response)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random Llama model")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--schedules", nargs="*", choices=SCHEDULES, default=list(SCHEDULES),
                        help="schedules of the memory comparison (pp=2)")  # fmt: skip
    parser.add_argument("--layouts", nargs="*", type=parse_layout, default=[(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1)],
                        help="layouts of the step-time comparison (t1p2d1v2: interleaved, 2 stages per rank)")  # fmt: skip
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="also compare t2p1d1 with and without engine.sequence_parallel (memory and step time)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement (after one warm-up)")
    parser.add_argument("--baseline-tree", help="another hfrt checkout whose engine is timed beside this one "
                        "(a folder holding an `hfrt` package with roles/, protocols/ ... inside it)")  # fmt: skip
    add_output_flags(parser)
    args = parser.parse_args(argv)
    common = {"seq": args.seq, "hidden": args.hidden, "layers": args.layers, "steps": args.steps}
    result: dict[str, Any] = {"machine": machine(), "settings": common | {"micro_batches": args.micro_batches}}
    memory: dict[str, Any] = {}
    for schedule in args.schedules:
        memory[schedule] = measure(common | schedule_settings(schedule, args.micro_batches), None)
        m = memory[schedule]
        print(f"pp=2 {schedule:16s} {args.micro_batches} micro-batches: activations held for backward at most "
              f"{m['peak_saved_for_backward_mb']} MB, RSS +{m['peak_rss_rise_mb']} MB, step {m['step_s']} s", flush=True)
    for a, b in (("1f1b", "gpipe"), ("interleaved-1f1b", "1f1b")):
        if a in memory and b in memory:
            ratio = memory[a]["peak_saved_for_backward_mb"] / max(memory[b]["peak_saved_for_backward_mb"], 1e-9)
            memory[f"saved_ratio_{a}_vs_{b}"] = round(ratio, 3)
            memory[f"step_ratio_{a}_vs_{b}"] = round(memory[a]["step_s"] / memory[b]["step_s"], 3)
    result["memory"] = memory
    timing = {}
    for tp, pp, dp, virtual in args.layouts:
        name = f"t{tp}p{pp}d{dp}" + (f"v{virtual}" if virtual > 1 else "")
        schedule = "interleaved-1f1b" if virtual > 1 else "1f1b"
        settings = common | {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule, "virtual": virtual, "rows": 8,
                             "micro_batch_size": 2}  # fmt: skip
        row = {"new": measure(settings, None)}
        if args.baseline_tree:
            row["baseline"] = measure(settings, str(Path(args.baseline_tree).resolve()))
            row["step_ratio_new_vs_baseline"] = round(row["new"]["step_s"] / row["baseline"]["step_s"], 3)
        timing[name] = row
        print(name, json.dumps(row), flush=True)
    result["step_time"] = timing
    if args.sequence_parallel:
        result["sequence_parallel"] = sequence_parallel(common, args.micro_batches)
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
