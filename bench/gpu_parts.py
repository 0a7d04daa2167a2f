"""Parts of the one-call GPU check (bench/gpu_check.py runs each in its own process, time-boxed):
`env` (what the machine has), `models` (random-weights folders of real size from
bench/gpu_models.py), `transition` (the hybrid engine's train → generate → train switch on one of
them: push time beside a plain device-to-device copy of the same weights, and the device memory
that sleep frees). Each prints one JSON object as its last stdout line.

Run: `python -m hfrt.bench.gpu_parts PART --workdir DIR [--cpu]`. It knows the hybrid engine's
interface and torch's memory counters; nothing of the check's schedule.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: what `models` builds: (name, dtype) on a GPU, the tiny stand-in with --cpu
GPU_MODELS = ("qwen3-0.6b", "qwen3-1.7b")
CPU_MODELS = ("qwen3-tiny",)
#: the packages the check wants beside torch and transformers (bench/gpu/requirements.txt)
WANTED = ("zmq", "msgpack", "structlog", "uvloop", "pytest", "pytest_asyncio", "trl", "peft", "accelerate", "datasets",
          "safetensors", "tokenizers", "psutil", "vllm")


def env(_args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
                           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "importable": {m: importlib.util.find_spec(m) is not None for m in WANTED}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {"device": props.name, "device_count": torch.cuda.device_count(), "device_memory_mb": props.total_memory // 2**20,
                "bf16": torch.cuda.is_bf16_supported()}
    return out


def models(args: argparse.Namespace) -> dict[str, Any]:
    from hfrt.bench.gpu_models import build_folder

    device, names = ("cpu", CPU_MODELS) if args.cpu else ("cuda", GPU_MODELS)
    built = [build_folder(name, Path(args.workdir) / "models" / name, device=device, dtype=dtype(args)) for name in names]
    return {"models": built}


def dtype(args: argparse.Namespace) -> str:
    return "float32" if args.cpu else "bfloat16"


def model_folder(args: argparse.Namespace, index: int = -1) -> str:
    names = CPU_MODELS if args.cpu else GPU_MODELS
    folder = Path(args.workdir) / "models" / names[index]
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: no model folder (the models part did not run or failed)")
    return str(folder)


def _allocated_mb() -> float:
    import torch

    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**20


def transition(args: argparse.Namespace) -> dict[str, Any]:
    """The largest model's train → generate → train switch, `repeats` times: the push time, a
    plain copy of the same weights between two device buffers, and device memory in each phase."""
    import torch

    from hfrt.bench.transition_measure import plain_copy_seconds
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.generation.hybrid import HybridEngine
    from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
    from hfrt.roles.training.engines import EngineConfig, build_train_engine

    folder = model_folder(args)
    tokenizer = load_tokenizer(folder)
    train = build_train_engine(load_model(ModelConfig(folder, dtype(args))), EngineConfig(backend="local", trainable=False))
    gen = HFGenerationEngine(load_model(ModelConfig(folder, dtype(args))), pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    gen.sleep()
    hybrid = HybridEngine(train, gen)
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    prompt = [tokenizer("The sea is")["input_ids"]]
    phases: dict[str, list[float]] = {"train_mb": [], "generate_mb": [], "after_mb": [], "to_generate_s": [], "to_train_s": [],
                                      "generate_s": []}
    for _ in range(args.repeats):
        phases["train_mb"].append(_allocated_mb())
        phases["to_generate_s"].append(hybrid.to_generate()["timing/reshard_to_generate_s"])
        phases["generate_mb"].append(_allocated_mb())
        start = time.perf_counter()
        gen.generate(prompt, SamplingParams(max_new_tokens=8, n=4, temperature=1.0))
        phases["generate_s"].append(time.perf_counter() - start)
        phases["to_train_s"].append(hybrid.to_train()["timing/reshard_to_train_s"])
        phases["after_mb"].append(_allocated_mb())
    med = {k: round(statistics.median(v), 4) for k, v in phases.items()}
    weights_mb = sum(p.numel() * p.element_size() for p in train.model.parameters()) / 2**20
    copy_s = plain_copy_seconds(train.model, args.repeats)  # the same weights, one device buffer to another
    return {"model": Path(folder).name, "device": str(next(gen.model.parameters()).device), "weights_mb": round(weights_mb, 1),
            **med, "freed_by_sleep_mb": round(med["generate_mb"] - med["after_mb"], 1), "plain_copy_s": round(copy_s, 4),
            "to_generate_over_copy": round(med["to_generate_s"] / max(copy_s, 1e-9), 2),
            "memory_counted": torch.cuda.is_available(),  # device memory is CUDA's allocator's; on the CPU none is counted
            "peak_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None}


PARTS = {"env": env, "models": models, "transition": transition}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfrt.bench.gpu_parts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=sorted(PARTS), help="which part to run")
    p.add_argument("--workdir", required=True, help="folder for model folders and scratch files")
    p.add_argument("--cpu", action="store_true", help="tiny models on the CPU (the check's test run)")
    p.add_argument("--repeats", type=int, default=3, help="round trips of the transition (medians reported)")
    args = p.parse_args(argv)
    print(json.dumps(PARTS[args.part](args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
