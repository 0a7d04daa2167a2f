"""hfrt against TRL: GRPO steps of hfrt's flow and of TRL's GRPOTrainer on the same model, prompts,
reward and shape, interleaved in one run (one hfrt step, then one TRL step, ...).

Run: `hfrt bench vs-trl [--model tiny|smollm2-135m|DIR] [--steps N] [--warmup K] [--prompts 8]
[--n 4] [--max-new-tokens 16] [--engine hf|vllm] [--stream-chunks K] [--max-tokens-per-micro-batch T]
[--pack] [--trl-gradient-checkpointing] [--lora [RANK]] [--json] [--out FILE]`. Needs `trl` (the
`bench` extra); without it the command says how to install it and exits 2. `--lora` trains LoRA
adapters on both sides with one peft config (every linear layer, alpha --lora-alpha); hfrt then
runs no reference daemon (the actor's adapters-off model is the reference, as TRL's with PEFT).

TRL runs at its fastest: gradient checkpointing off (GRPOConfig's default in trl 1.16 is on; the
flag turns it back on); its GRPOConfig has no padding-free or packing option. Besides step times
the result holds each step's padding fraction (before token budgets / as hfrt's engine plans its
micro-batches), the peak RSS of hfrt's daemons, and the load average at start and end
(bench/vs_trl_measure.py).

Both sides: fp32 on CPU, the addition task's prompts as plain strings (the same rows in the same
order), its rule reward, n samples per prompt, temperature 1, KL loss 0.001 (k3 / low_var_kl),
token-mean loss, advantages not divided by the group's std, no entropy bonus, one optimizer step
per rollout over all rows in one micro-batch. hfrt's daemons run as usual (one process per role);
TRL runs in one child process that waits before each step until told to go, so the two never
compute at the same time. A step's tokens are the generated completion tokens up to and including
EOS, no padding (`completion_tokens`); tokens/s is a step's tokens over its wall time. Reported:
medians over the measured steps, `speedup` = trl_step_s / hfrt_step_s, and each side's time per
stage. It knows the GRPO flow's step function and TRL's trainer API; nothing of how either computes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hfrt.bench.common import StepProcess, add_output_flags, emit, machine

INSTALL_HINT = (
    "hfrt bench vs-trl needs TRL: pip install 'hfrt[bench]' (or pip install 'trl==1.16.*' "
    "-c <(echo torch==$(python -c 'import torch; print(torch.__version__)')) so it keeps your torch)"
)


@dataclass(frozen=True)
class Shape:
    """What both sides run: model (a preset or an HF folder), prompts × n samples, new tokens,
    learning rate, seed, max operand of the addition prompts, torch threads of each process."""

    model: str = "tiny"
    prompts: int = 8
    n: int = 4
    max_new_tokens: int = 16
    lr: float = 1e-6
    seed: int = 0
    max_operand: int = 9
    threads: int = 0  # 0: every core
    stream_chunks: int = 1  # hfrt's generate calls per step (streamed scoring)
    max_tokens_per_micro_batch: int | None = None  # hfrt's token budget (actor and reference); None: rows
    pack: bool = False  # hfrt's padding-free micro-batches
    trl_gradient_checkpointing: bool = False  # TRL 1.16's GRPOConfig turns it on by default; off is its fastest
    lora_rank: int = 0  # > 0: both sides train LoRA adapters (peft, this rank, lora_alpha, every linear layer)
    lora_alpha: float = 32.0
    micro_batch_size: int = 0  # rows per forward / backward on both sides (TRL: gradient accumulation); 0: all rows at once
    trl_vllm: bool = False  # TRL samples with vLLM in colocate mode (in its own process) instead of transformers' generate
    dtype: str = "float32"  # bfloat16: hfrt's daemons load bf16 (fp32 masters), TRL trains fp32 weights with bf16=True
    prompt_prefix: str = ""  # a built-in text put before every prompt (bench/vs_trl_shapes.py: "tools", a tool-schema system prompt)

    def micro(self) -> int:
        """Rows per micro-batch: micro_batch_size, or every row of a step."""
        return self.micro_batch_size or self.prompts * self.n


def completion_tokens(rows: Iterable[Sequence[int]], eos_ids: Collection[int], pad_id: int | None) -> int:
    """Generated tokens of completions counted the same way on both sides: each row up to and
    including its first EOS; a pad token (when it is not an EOS) ends the row without counting."""
    total = 0
    for row in rows:
        for token in row:
            if token in eos_ids:
                total += 1
                break
            if token == pad_id:
                break
            total += 1
    return total


def prompt_rows(shape: Shape, steps: int) -> dict[str, list[Any]]:
    """Every step's prompts, in order: the addition task's stream from shape.seed."""
    from hfrt.bench.vs_trl_shapes import with_prefix
    from hfrt.flows.tasks import AdditionTask

    return with_prefix(AdditionTask(shape.seed, shape.max_operand).batch(shape.prompts * steps), shape.prompt_prefix)


def thread_count(shape: Shape) -> int:
    return shape.threads or os.cpu_count() or 1


# ----------------------------------------------------------------------------------- TRL side


def trl_worker(shape: Shape, steps: int, conn: Any) -> None:
    """The TRL process: build a GRPOTrainer, say ready, then run `steps` optimizer steps, each
    after a "go" from the parent; after each, send {step_s, tokens, generate_s}."""
    try:
        _trl_run(shape, steps, conn)
    except BaseException as exc:  # the parent reports it; a traceback here helps
        import traceback

        conn.send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        raise


def _trl_run(shape: Shape, steps: int, conn: Any) -> None:
    start = time.perf_counter()
    import torch

    torch.set_num_threads(thread_count(shape))
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hfrt.bench.vs_trl_shapes import trl_vllm_args
    from hfrt.flows.tasks import addition_reward
    from hfrt.roles.models import ModelConfig, load_model, load_tokenizer, resolve_model_dir

    folder = resolve_model_dir(shape.model, shape.seed)
    tokenizer = load_tokenizer(str(folder), shape.seed)
    model = load_model(ModelConfig(str(folder), "float32", seed=shape.seed))
    eos = {int(tokenizer.eos_token_id)}
    counted = {"tokens": 0, "generate_s": 0.0}

    def reward(prompts: list[Any], completions: list[str], completion_ids: list[list[int]], ground_truth: list[str], **_: Any) -> list[float]:
        counted["tokens"] += completion_tokens(completion_ids, eos, tokenizer.pad_token_id)
        return [addition_reward(c, t) for c, t in zip(completions, ground_truth, strict=True)]

    class Timed(GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                counted["generate_s"] += time.perf_counter() - t0

    class Gate(TrainerCallback):  # type: ignore[misc]
        t0 = cpu0 = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if conn.recv() != "go":
                raise SystemExit(0)
            counted.update(tokens=0, generate_s=0.0)
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            conn.send({"step_s": time.perf_counter() - self.t0, "cpu_s": time.process_time() - self.cpu0, **counted})

    rows = prompt_rows(shape, steps)
    batch = shape.prompts * shape.n
    micro = shape.micro()  # one optimizer step per rollout: the rollout in batch / micro accumulated micro-batches
    with tempfile.TemporaryDirectory(prefix="hfrt-vs-trl-") as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=not torch.cuda.is_available(), bf16=shape.dtype == "bfloat16", fp16=False, seed=shape.seed, learning_rate=shape.lr,
            per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro, num_generations=shape.n,
            max_completion_length=shape.max_new_tokens, temperature=1.0, top_p=1.0, beta=0.001,
            num_iterations=1, scale_rewards="none", loss_type="dapo", max_steps=steps, shuffle_dataset=False,
            save_strategy="no", report_to=[], logging_steps=10**6, disable_tqdm=True, max_grad_norm=1.0,
            dataloader_num_workers=0, gradient_checkpointing=shape.trl_gradient_checkpointing,
            **trl_vllm_args(shape.trl_vllm, 512),
        )
        trainer = Timed(
            model=model, reward_funcs=reward, args=args,  # type: ignore[arg-type]
            train_dataset=Dataset.from_dict(rows), processing_class=tokenizer, callbacks=[Gate()], **trl_lora(shape),
        )
        conn.send({"ready_s": time.perf_counter() - start})
        trainer.train()
    conn.send({"done": True})


def trl_process(shape: Shape, steps: int) -> StepProcess:
    """The TRL child process, driven one step at a time."""
    return StepProcess(trl_worker, (shape, steps), what="TRL", name="hfrt-vs-trl")


# ---------------------------------------------------------------------------------- hfrt side


def hfrt_roles(shape: Shape, engine: str) -> dict[str, dict[str, Any]]:
    """The GRPO flow's default daemons on shape.model: shape.micro() rows a micro-batch, every core."""
    from hfrt.flows.recipes import grpo

    roles = {name: {**spec, "options": dict(spec.get("options", {}))} for name, spec in grpo.ROLES.items()}
    micro = shape.micro()
    common = {"model": shape.model, "seed": shape.seed, "threads": thread_count(shape), "dtype": shape.dtype}
    budget = {"max_tokens_per_micro_batch": shape.max_tokens_per_micro_batch} if shape.max_tokens_per_micro_batch else {}
    budget |= {"pack": True} if shape.pack else {}
    roles["actor"]["options"] |= common | {
        "engine": {"micro_batch_size": micro, "optim": {"lr": shape.lr}, **budget}, "generator": engine,
    }
    if engine == "vllm":  # fp32 like everything else here (vLLM's "auto" is the model's bf16: emulated on most CPUs)
        roles["actor"]["options"]["vllm"] = {"dtype": "float32"}
    roles["reference"]["options"] |= common | {"engine": {"micro_batch_size": micro, **budget}}
    if shape.lora_rank:  # the actor's adapters-off model is the reference (reference_from_actor): no reference daemon
        roles["actor"]["options"]["lora"] = lora_table(shape)
        del roles["reference"]
    return roles


def lora_table(shape: Shape) -> dict[str, Any]:
    """hfrt's options.lora for shape's LoRA (dropout 0, every linear layer but the head)."""
    return {"rank": shape.lora_rank, "alpha": shape.lora_alpha, "dropout": 0.0, "target_modules": "all-linear"}


def trl_lora(shape: Shape) -> dict[str, Any]:
    """GRPOTrainer's peft_config for shape's LoRA: the same LoraConfig hfrt's actor builds (TRL then
    takes reference log-probs from the model with adapters disabled, as hfrt does)."""
    if not shape.lora_rank:
        return {}
    from hfrt.roles.training.lora import LoraSpec

    spec = LoraSpec.read(lora_table(shape), "vs-trl --lora")
    assert spec is not None
    return {"peft_config": spec.peft_config()}


def hfrt_config(shape: Shape, steps: int) -> Any:
    from hfrt.flows.grpo_family import GRPOFlowConfig

    return GRPOFlowConfig.read({  # every setting given: the same run as GRPOConfig, streamed scoring allowed
        "run_dir": "", "progress": "off", "tensorboard": False, "trace": False, "steps": steps,
        "prompts_per_step": shape.prompts, "n": shape.n, "max_new_tokens": shape.max_new_tokens,
        "temperature": 1.0, "entropy_coeff": 0.0, "kl_loss_coef": 0.001, "norm_adv_by_std": False,
        "seed": shape.seed, "max_operand": shape.max_operand, "stream_chunks": shape.stream_chunks,
    })


async def interleaved(ctl: Any, shape: Shape, steps: int, trl: StepProcess, start: float) -> dict[str, Any]:
    """`steps` hfrt GRPO steps, each followed by one TRL step; every step's figures, and each
    side's start-up time (from `start` until its daemons / trainer are ready)."""
    import asyncio

    from hfrt.bench.vs_trl_measure import DaemonRSS, ProcessCPU, padding_fractions, row_lengths
    from hfrt.bench.vs_trl_shapes import mean_prompt_tokens
    from hfrt.flows.batches import non_tensor, prompts_handle
    from hfrt.flows.recipes import grpo
    from hfrt.flows.trainer import get_roles
    from hfrt.roles.models import load_tokenizer

    cfg = hfrt_config(shape, steps)
    roles = await get_roles(ctl, "actor", "reference", "reward")
    hfrt_ready = time.perf_counter() - start
    ready = await asyncio.to_thread(trl.receive)
    rows = prompt_rows(shape, steps)
    # off the event loop: SmolLM2's tokenizer takes ~20 s to build on a loaded 2-core machine, and a
    # controller that sends no heartbeat for 30 s has its daemons exit as orphans
    tokenizer = await asyncio.to_thread(load_tokenizer, shape.model, shape.seed)
    prompt_tokens = mean_prompt_tokens(tokenizer, rows["prompt"])
    engine = hfrt_roles(shape, "hf")["actor"]["options"]["engine"]
    rss = DaemonRSS(exclude=[trl.proc.pid] if trl.proc.pid else [])
    rss.start()
    hfrt_steps, trl_steps = [], []
    cpu = ProcessCPU(exclude=trl.proc.pid)
    for step in range(steps):
        lo, hi = step * shape.prompts, (step + 1) * shape.prompts
        prompts = prompts_handle({k: v[lo:hi] for k, v in rows.items()})
        seen = Recorder(roles["reward"])
        cpu0, start = cpu.seconds(), time.perf_counter()
        record = await grpo.grpo_step(cfg, step, prompts, **(roles | {"reward": seen}))
        record["wall_s"], record["cpu_s"] = time.perf_counter() - start, cpu.seconds() - cpu0
        prompt_len, response_len = row_lengths(tokenizer, non_tensor(seen.rollout, "prompt"), non_tensor(seen.rollout, "response"), 1)
        record |= padding_fractions(prompt_len, response_len, engine)
        hfrt_steps.append(record)
        trl_steps.append(await asyncio.to_thread(trl.step))
    return {"hfrt": hfrt_steps, "trl": trl_steps, "trl_ready_s": ready["ready_s"], "hfrt_ready_s": hfrt_ready,
            "prompt_tokens": prompt_tokens} | rss.stop()


class Recorder:
    """The reward role, keeping the rollout it was asked to score (its inline text columns give
    the rows' lengths; no tensor is pulled): chunks of a streamed step are joined."""

    def __init__(self, reward: Any) -> None:
        self.reward, self.parts = reward, list[Any]()

    @property
    def rollout(self) -> Any:
        from hfrt.protocols import BatchHandle

        return BatchHandle.concat(self.parts)

    def score(self, rollout: Any, **kwargs: Any) -> Any:
        self.parts.append(rollout)
        return self.reward.score(rollout, **kwargs)


def measure(shape: Shape, steps: int, warmup: int, engine: str, keep: str | None = None, heartbeat_s: float = 2.0) -> dict[str, Any]:
    """Start hfrt's daemons and the TRL process, run warmup + steps interleaved steps, summarize."""
    from hfrt.flows import Flow
    from hfrt.session import run_flow
    from hfrt.wire.loop import run

    total = warmup + steps
    trl = trl_process(shape, total)
    try:
        start = time.perf_counter()

        async def flow(ctl: Any, _config: dict[str, Any]) -> dict[str, Any]:
            return await interleaved(ctl, shape, total, trl, start)

        if keep:  # the daemons' logs stay in this folder
            out = run(run_flow(Flow("bench-vs-trl", flow, hfrt_roles(shape, engine)), run_dir=Path(keep), config={}, heartbeat_s=heartbeat_s))
        else:
            with tempfile.TemporaryDirectory(prefix="hfrt-vs-trl-run-") as run_dir:
                out = run(run_flow(Flow("bench-vs-trl", flow, hfrt_roles(shape, engine)), run_dir=Path(run_dir), config={}, heartbeat_s=heartbeat_s))
    finally:
        trl.close()
    return summarize(out, warmup) | {"model": shape.model, "engine": engine}


def summarize(out: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Medians over the measured steps of both sides, their ratio, and each side's stages."""
    def med(values: Iterable[float]) -> float:
        return round(statistics.median(list(values)), 4)

    ours, theirs = out["hfrt"][warmup:], out["trl"][warmup:]
    hfrt_s, trl_s = med(r["wall_s"] for r in ours), med(r["step_s"] for r in theirs)
    stages = sorted({k for r in ours for k in r if k.startswith(("timing/", "rollout/timing/"))})
    return {
        "hfrt_step_s": hfrt_s, "trl_step_s": trl_s,
        "hfrt_tokens_per_s": med(r["response_tokens"] / r["wall_s"] for r in ours),
        "trl_tokens_per_s": med(r["tokens"] / r["step_s"] for r in theirs),
        "speedup": round(trl_s / hfrt_s, 3),
        "hfrt_tokens": med(r["response_tokens"] for r in ours), "trl_tokens": med(r["tokens"] for r in theirs),
        "hfrt_stages_s": {k.replace("timing/", "", 1): med(r[k] for r in ours if k in r) for k in stages},
        "trl_stages_s": {"generate_score_ref": med(r["generate_s"] for r in theirs),
                         "update": med(r["step_s"] - r["generate_s"] for r in theirs)},
        "hfrt_startup_s": round(out["hfrt_ready_s"], 2), "trl_startup_s": round(out["trl_ready_s"], 2),
        "hfrt_steps_s": [round(r["wall_s"], 3) for r in ours], "trl_steps_s": [round(r["step_s"], 3) for r in theirs],
        **cpu_figures(ours, theirs),
        "hfrt_reward_mean": med(r["reward/mean"] for r in ours),
        **{f"response_length_{k}": med(r[f"response_length/{k}"] for r in ours) for k in ("mean", "min", "max")
           if all(f"response_length/{k}" in r for r in ours)},
        **{k: med(r[k] for r in ours) for k in ("padding_before", "padding_after") if all(k in r for r in ours)},
        **{k: out[k] for k in ("hfrt_peak_daemon_rss_mb", "hfrt_peak_daemons_rss_total_mb", "prompt_tokens") if k in out},
    }


def cpu_figures(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, float]:
    """Each side's median CPU seconds a step (hfrt: controller and daemons; TRL: its process, every
    thread) and their ratio, which other jobs on a shared machine move far less than wall time."""
    if not all("cpu_s" in r for r in ours + theirs):
        return {}
    ours_s, theirs_s = statistics.median(r["cpu_s"] for r in ours), statistics.median(r["cpu_s"] for r in theirs)
    return {"hfrt_cpu_s": round(ours_s, 3), "trl_cpu_s": round(theirs_s, 3), "speedup_cpu": round(theirs_s / ours_s, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench vs-trl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset (tiny, smollm2-135m) or a Hugging Face model folder")
    p.add_argument("--steps", type=int, default=5, help="measured steps per side (medians are over these)")
    p.add_argument("--warmup", type=int, default=1, help="steps per side run first and left out of the figures")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16, help="completion length limit")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of both sides")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: every core)")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="hfrt's generation engine (TRL uses transformers' generate)")
    p.add_argument("--stream-chunks", type=int, default=1, help="hfrt's generate calls per step, scored as each arrives")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=None, help="hfrt's token budget per micro-batch (actor, reference)")
    p.add_argument("--pack", action="store_true", help="hfrt's padding-free micro-batches")
    p.add_argument("--micro-batch-size", type=int, default=0,
                   help="rows per forward / backward on both sides (TRL: gradient accumulation; hfrt: without a budget); 0: all rows")
    p.add_argument("--trl-gradient-checkpointing", action="store_true", help="leave TRL's default gradient checkpointing on (slower)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", nargs="?", const=16,
                   help="both sides train LoRA adapters of this rank (bare --lora: 16) on every linear layer, same peft config")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="hfrt's daemons' parameter dtype; bfloat16: TRL with bf16=True (both on the GPU when there is one)")
    p.add_argument("--trl-vllm", action="store_true", help="TRL samples with vLLM in colocate mode (use_vllm, vllm_mode='colocate')")
    p.add_argument("--prompt-prefix", default="", choices=["", "tools"], help="text before every prompt: tools, a tool-schema system prompt (~300 tokens)")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha with --lora")
    p.add_argument("--heartbeat-s", type=float, default=2.0,
                   help="daemon heartbeat interval (a daemon silent for a few intervals is declared gone): raise it on an overloaded machine")
    p.add_argument("--run-dir", help="keep hfrt's run folder (daemon logs) here instead of a temporary one")
    add_output_flags(p)
    args = p.parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    if args.micro_batch_size < 0 or (args.micro_batch_size and (args.prompts * args.n) % args.micro_batch_size):
        p.error(f"--micro-batch-size {args.micro_batch_size} must divide prompts × n = {args.prompts * args.n}")
    if args.steps < 1 or args.warmup < 0 or args.prompts < 1 or args.n < 2 or args.max_new_tokens < 1:
        p.error("need --steps >= 1, --warmup >= 0, --prompts >= 1, --n >= 2 and --max-new-tokens >= 1")
    from hfrt.bench.vs_trl_shapes import trl_mode
    from hfrt.log import configure as configure_logging

    configure_logging("warning")
    shape = Shape(args.model, args.prompts, args.n, args.max_new_tokens, args.lr, threads=args.threads,
                  stream_chunks=args.stream_chunks, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                  pack=args.pack, trl_gradient_checkpointing=args.trl_gradient_checkpointing,
                  lora_rank=args.lora, lora_alpha=args.lora_alpha, micro_batch_size=args.micro_batch_size,
                  trl_vllm=args.trl_vllm, prompt_prefix=args.prompt_prefix, dtype=args.dtype)
    load_start = [round(x, 2) for x in os.getloadavg()]
    result = measure(shape, args.steps, args.warmup, args.engine, args.run_dir, args.heartbeat_s)
    shape_out = asdict(shape) | {"prompt_tokens": result.pop("prompt_tokens", None), "trl_mode": trl_mode(shape.trl_vllm)}
    result |= {"steps": args.steps, "warmup": args.warmup, "shape": shape_out, **machine(), "load_avg_start": load_start,
               "trl_padding_free": "GRPOConfig (trl 1.16) has no padding-free or packing option; completions are right-padded to the longest"}
    print(f"{'':<24}{'hfrt':>10}{'TRL':>10}")
    for label, a, b in (("step (s)", "hfrt_step_s", "trl_step_s"), ("tokens / s", "hfrt_tokens_per_s", "trl_tokens_per_s"),
                        ("start-up (s)", "hfrt_startup_s", "trl_startup_s")):
        print(f"{label:<24}{result[a]:>10}{result[b]:>10}")
    print(f"speedup (TRL step / hfrt step): {result['speedup']}   load average {load_start} -> {result['load_avg']}")
    emit(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
