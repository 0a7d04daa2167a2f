"""hfrt's `sft` against TRL's SFTTrainer: optimizer steps of supervised fine-tuning on the same
model, rows and shape, interleaved in one run (one hfrt step, then one TRL step, ...).

Run: `hfrt bench vs-trl-sft` (or `python -m hfrt.bench.vs_trl_sft`) `[--model tiny|smollm2-135m|DIR] [--steps N] [--warmup K] [--rows 8]
[--words 24] [--micro-batch-size 0] [--max-tokens-per-micro-batch T] [--pack] [--threads 0]
[--json] [--out FILE]`. Needs `trl` (the `bench` extra); without it the command says how to
install it and exits 2.

Both sides: fp32 on CPU, AdamW at a constant learning rate, `rows` prompt-completion rows a step
(addition prompts answered by a sentence of about `words` words, so rows differ in length), the
same rows in the same order, the loss on the completion tokens only, one optimizer step over the
rows (in micro-batches of `micro-batch-size` rows: TRL accumulates gradients over them). hfrt's
actor runs as a daemon (sft_update calls, as the flow makes them); TRL runs in one child process
that waits before each step until told to go, so the two never compute at the same time. TRL runs
at its fastest: gradient checkpointing off (SFTConfig's default is on), no bf16 (its default on
CPUs that have it). Reported: median step times over the measured steps, `speedup` = trl / hfrt,
completion tokens a second, and the two sides' first-step losses (equal: the same rows, model and
loss). It knows the actor's sft endpoints and TRL's trainer API; nothing of how either computes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hfrt.bench.common import StepProcess, add_output_flags, emit, machine
from hfrt.bench.vs_trl import INSTALL_HINT

WORDS = ("the", "sum", "of", "these", "two", "numbers", "is", "found", "by", "counting", "on", "from", "first", "one")


@dataclass(frozen=True)
class Shape:
    """What both sides run: model (a preset or an HF folder), rows a step, completion words,
    learning rate, seed, torch threads of each process, micro-batching."""

    model: str = "tiny"
    rows: int = 8
    words: int = 24
    lr: float = 1e-5
    seed: int = 0
    threads: int = 0  # 0: every core
    micro_batch_size: int = 0  # rows per forward / backward on both sides; 0: every row of a step
    max_tokens_per_micro_batch: int | None = None  # hfrt's token budget; None: rows
    pack: bool = False  # hfrt's padding-free micro-batches

    def micro(self) -> int:
        return self.micro_batch_size or self.rows


def sft_rows(shape: Shape, steps: int) -> list[dict[str, str]]:
    """steps × rows prompt-completion rows: "a+b=" answered by a sentence of 1 to `words` words."""
    import random

    rng = random.Random(shape.seed)
    out = []
    for i in range(steps * shape.rows):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, shape.words)))
        out.append({"prompt": f"Q{i}: {a}+{b}=", "completion": f" {a + b}, as {sentence}."})
    return out


def threads(shape: Shape) -> int:
    return shape.threads or (os.cpu_count() or 1)


def trl_worker(shape: Shape, steps: int, conn: Any) -> None:
    """The TRL side, in its own process: SFTTrainer over the same rows, one step per "go"."""
    try:
        run_trl(shape, steps, conn)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises it
        import traceback

        conn.send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def run_trl(shape: Shape, steps: int, conn: Any) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from hfrt.roles.models import ModelConfig, load_model, load_tokenizer

    start = time.perf_counter()
    torch.set_num_threads(threads(shape))
    model, tokenizer = load_model(ModelConfig(shape.model, seed=shape.seed)), load_tokenizer(shape.model, shape.seed)
    losses: list[float] = []

    class Gate(TrainerCallback):  # type: ignore[misc]
        t0 = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if conn.recv() != "go":
                raise SystemExit(0)
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            conn.send({"step_s": time.perf_counter() - self.t0})

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class Ordered(SFTTrainer):  # type: ignore[misc]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(range(steps * shape.rows))  # the rows in the order hfrt takes them

    with tempfile.TemporaryDirectory(prefix="hfrt-vs-trl-sft-") as out:
        args = SFTConfig(
            output_dir=out, use_cpu=True, bf16=False, fp16=False, seed=shape.seed, learning_rate=shape.lr,
            lr_scheduler_type="constant", per_device_train_batch_size=shape.micro(),
            gradient_accumulation_steps=shape.rows // shape.micro(), max_steps=steps, shuffle_dataset=False,
            save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True, max_grad_norm=1.0, weight_decay=0.0,
            dataloader_num_workers=0, gradient_checkpointing=False, max_length=None,
        )
        trainer = Ordered(model=model, args=args, train_dataset=Dataset.from_list(sft_rows(shape, steps)),
                          processing_class=tokenizer, callbacks=[Gate()])
        trainer.remove_callback(PrinterCallback)  # its log lines would interleave with the table
        conn.send({"ready_s": time.perf_counter() - start})
        trainer.train()
    conn.send({"done": True, "losses": losses})


def trl_process(shape: Shape, steps: int) -> StepProcess:
    """The TRL child process, driven one step at a time."""
    return StepProcess(trl_worker, (shape, steps), what="TRL", name="hfrt-vs-trl-sft")


def actor_role(shape: Shape) -> dict[str, dict[str, Any]]:
    """The sft flow's actor on shape.model, shape.micro() rows a micro-batch (or the token budget)."""
    engine: dict[str, Any] = {"micro_batch_size": shape.micro(), "optim": {"lr": shape.lr}}
    if shape.max_tokens_per_micro_batch:
        engine["max_tokens_per_micro_batch"] = shape.max_tokens_per_micro_batch
    if shape.pack:
        engine["pack"] = True
    options = {"model": shape.model, "seed": shape.seed, "threads": threads(shape), "engine": engine}
    return {"actor": {"impl": "actor", "options": options}}


async def interleaved(ctl: Any, shape: Shape, steps: int, trl: StepProcess, start: float) -> dict[str, Any]:
    """`steps` hfrt sft_update calls, each followed by one TRL step; each side's step figures."""
    import asyncio

    from hfrt.flows.batches import prompts_handle
    from hfrt.flows.metrics import reduce_rank_metrics
    from hfrt.flows.sft_data import sft_columns
    from hfrt.flows.trainer import get_roles

    actor = (await get_roles(ctl, "actor"))["actor"]
    hfrt_ready = time.perf_counter() - start
    ready = await asyncio.to_thread(trl.receive)
    rows = sft_rows(shape, steps)
    ours, theirs = [], []
    for step in range(steps):
        batch = prompts_handle(sft_columns(rows[step * shape.rows : (step + 1) * shape.rows]))
        t0 = time.perf_counter()
        metrics = reduce_rank_metrics(await actor.sft_update(batch, max_length=None))
        ours.append(metrics | {"wall_s": time.perf_counter() - t0})
        theirs.append(await asyncio.to_thread(trl.step))
    done = await asyncio.to_thread(trl.receive)
    return {"hfrt": ours, "trl": theirs, "trl_losses": done.get("losses", []), "hfrt_ready_s": hfrt_ready,
            "trl_ready_s": ready["ready_s"]}


def measure(shape: Shape, steps: int, warmup: int) -> dict[str, Any]:
    from hfrt.flows import Flow
    from hfrt.session import run_flow
    from hfrt.wire.loop import run

    total = warmup + steps
    trl = trl_process(shape, total)
    try:
        start = time.perf_counter()

        async def flow(ctl: Any, _config: dict[str, Any]) -> dict[str, Any]:
            return await interleaved(ctl, shape, total, trl, start)

        with tempfile.TemporaryDirectory(prefix="hfrt-vs-trl-sft-run-") as run_dir:
            out = run(run_flow(Flow("bench-vs-trl-sft", flow, actor_role(shape)), run_dir=Path(run_dir), config={}))
    finally:
        trl.close()
    return summarize(out, warmup)


def summarize(out: dict[str, Any], warmup: int) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 4)

    ours, theirs = out["hfrt"][warmup:], out["trl"][warmup:]
    hfrt_s, trl_s = med([r["wall_s"] for r in ours]), med([r["step_s"] for r in theirs])
    tokens = med([r["sft/tokens"] for r in ours])
    first_trl = out["trl_losses"][0] if out["trl_losses"] else None
    return {
        "hfrt_step_s": hfrt_s, "trl_step_s": trl_s, "speedup": round(trl_s / hfrt_s, 3),
        "completion_tokens": tokens, "hfrt_tokens_per_s": round(tokens / hfrt_s, 1), "trl_tokens_per_s": round(tokens / trl_s, 1),
        "hfrt_update_s": med([r["timing/update_sft_s"] for r in ours]),
        "first_loss_hfrt": round(out["hfrt"][0]["sft/loss"], 6), "first_loss_trl": None if first_trl is None else round(first_trl, 6),
        "hfrt_steps_s": [round(r["wall_s"], 3) for r in ours], "trl_steps_s": [round(r["step_s"], 3) for r in theirs],
        "hfrt_startup_s": round(out["hfrt_ready_s"], 2), "trl_startup_s": round(out["trl_ready_s"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench vs-trl-sft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset (tiny, smollm2-135m) or a Hugging Face model folder")
    p.add_argument("--steps", type=int, default=5, help="measured steps per side (medians are over these)")
    p.add_argument("--warmup", type=int, default=1, help="steps per side run first and left out of the figures")
    p.add_argument("--rows", type=int, default=8, help="rows per optimizer step")
    p.add_argument("--words", type=int, default=24, help="the longest completion's sentence, in words")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate of both sides")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: every core)")
    p.add_argument("--micro-batch-size", type=int, default=0, help="rows per forward / backward on both sides; 0: all rows")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=None, help="hfrt's token budget per micro-batch")
    p.add_argument("--pack", action="store_true", help="hfrt's padding-free micro-batches")
    add_output_flags(p)
    args = p.parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        print(INSTALL_HINT.replace("vs-trl", "vs-trl-sft"), file=sys.stderr)
        return 2
    if args.steps < 1 or args.warmup < 0 or args.rows < 1 or args.words < 1:
        p.error("need --steps >= 1, --warmup >= 0, --rows >= 1 and --words >= 1")
    if args.micro_batch_size < 0 or (args.micro_batch_size and args.rows % args.micro_batch_size):
        p.error(f"--micro-batch-size {args.micro_batch_size} must divide --rows {args.rows}")
    from hfrt.log import configure as configure_logging

    configure_logging("warning")
    shape = Shape(args.model, args.rows, args.words, args.lr, threads=args.threads, micro_batch_size=args.micro_batch_size,
                  max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, pack=args.pack)
    load_start = [round(x, 2) for x in os.getloadavg()]
    result = measure(shape, args.steps, args.warmup)
    result |= {"steps": args.steps, "warmup": args.warmup, "shape": asdict(shape), **machine(), "load_avg_start": load_start,
               "load_avg": [round(x, 2) for x in os.getloadavg()]}
    print(f"{'':<24}{'hfrt':>10}{'TRL':>10}")
    for label, a, b in (("step (s)", "hfrt_step_s", "trl_step_s"), ("tokens / s", "hfrt_tokens_per_s", "trl_tokens_per_s"),
                        ("first loss", "first_loss_hfrt", "first_loss_trl"), ("start-up (s)", "hfrt_startup_s", "trl_startup_s")):
        print(f"{label:<24}{result[a]!s:>10}{result[b]!s:>10}")
    print(f"speedup (TRL step / hfrt step): {result['speedup']}   load average {load_start} -> {result['load_avg']}")
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
