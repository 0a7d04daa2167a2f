"""The device-mapping planner's cost model: hardware presets, model sizes, the workload, and the
memory and time of one role's call under a (pp, tp, dp) layout. Pure arithmetic, no torch.

It knows FLOPs, bytes and bandwidths; it does not know placements or search (deploy.plan does),
PLAN.toml files (deploy.plan_cli) or how daemons really run. Times come back as a `Cost`: raw
seconds per category at 100 % efficiency, so `Efficiency` factors (fitted by --calibrate) scale
them linearly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """One kind of device and the cluster's links. Bandwidths are bytes/s per device, one direction;
    latency_s is one collective's fixed cost; layer_s the fixed cost of one layer's pass over one
    micro-batch or decode step (kernel launches, small ops); param_bytes the weights' dtype size."""

    name: str
    memory_bytes: float
    peak_flops: float
    mem_bw: float
    intra_bw: float
    inter_bw: float
    latency_s: float
    layer_s: float
    param_bytes: int = 2
    device_type: str = "cuda"
    max_tp: int = 8
    max_pp: int = 16


#: Dense bf16 peaks and datasheet bandwidths; A100's inter-node link is the paper's testbed's
#: (800 Gb/s per 8-GPU machine). `cpu` is one core of a small machine running the role
#: daemons in float32; its daemons are data-parallel only (max_tp = max_pp = 1) until hfrt's roles
#: implement tensor and pipeline parallelism.
HARDWARE: dict[str, Hardware] = {
    "H100": Hardware("H100", 80e9, 989e12, 3.35e12, 450e9, 50e9, 10e-6, 60e-6),
    "H200": Hardware("H200", 141e9, 989e12, 4.8e12, 450e9, 50e9, 10e-6, 60e-6),
    "A100": Hardware("A100", 80e9, 312e12, 2.0e12, 300e9, 12.5e9, 10e-6, 80e-6),
    "cpu": Hardware("cpu", 8e9, 3e10, 1e10, 3e9, 1e9, 2e-4, 2e-4, param_bytes=4, device_type="cpu", max_tp=1, max_pp=1),
}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. params: total parameter count (computed when 0).
    lora_rank: > 0 when the role trains LoRA adapters (all-linear) instead of its full weights:
    grads, Adam state, the gradient all-reduce and the weight sync are the adapters' only."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    intermediate: int = 0
    kv_heads: int = 0
    params: float = 0.0
    tied: bool = False
    lora_rank: int = 0

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab"):
            if getattr(self, key) < 1:
                raise ValueError(f"model {self.name!r}: {key} must be >= 1 (got {getattr(self, key)})")
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name!r}: hidden {self.hidden} is not a multiple of heads {self.heads}")
        object.__setattr__(self, "intermediate", self.intermediate or 4 * self.hidden)
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "params", float(self.params or self.counted_params()))
        if self.lora_rank < 0:
            raise ValueError(f"model {self.name!r}: lora_rank must be >= 0 (got {self.lora_rank})")

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def counted_params(self) -> int:
        """Llama-style: attention (q, o full; k, v at kv_dim), gated MLP, two norms, embeddings."""
        h = self.hidden
        layer = 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate + 2 * h
        return self.layers * layer + self.vocab * h * (1 if self.tied else 2) + h

    @property
    def adapter_params(self) -> int:
        """LoRA's A and B on every linear layer of every block (q, k, v, o, gate, up, down):
        rank × (in + out) each; 0 without LoRA."""
        h, kv, inter = self.hidden, self.kv_dim, self.intermediate
        return self.layers * self.lora_rank * (2 * h + 2 * (h + kv) + 2 * h + 3 * (h + inter))

    @property
    def trained_params(self) -> float:
        """What gets gradients, optimizer state and is synced to generation: the adapters with LoRA."""
        return float(self.adapter_params) if self.lora_rank else self.params


#: Shapes of hfrt's own presets (roles/models.py: `tiny` is built there in code, `smollm2-135m`
#: comes from its GGUF file; a unit test checks these numbers against that file) and of the
#: paper's Llama sizes.
MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", layers=2, hidden=64, heads=4, vocab=259, intermediate=128, kv_heads=2),
    "smollm2-135m": ModelSpec("smollm2-135m", layers=30, hidden=576, heads=9, vocab=49152, intermediate=1536, kv_heads=3, tied=True),
    "llama-7b": ModelSpec("llama-7b", layers=32, hidden=4096, heads=32, vocab=32000, intermediate=11008),
    "llama-13b": ModelSpec("llama-13b", layers=40, hidden=5120, heads=40, vocab=32000, intermediate=13824),
    "llama-34b": ModelSpec("llama-34b", layers=48, hidden=8192, heads=64, vocab=32000, intermediate=22016, kv_heads=8),
    "llama-70b": ModelSpec("llama-70b", layers=80, hidden=8192, heads=64, vocab=32000, intermediate=28672, kv_heads=8),
}


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face folder's config.json (or the file itself)."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    try:
        c: dict[str, Any] = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {str(path)!r}: cannot read a Hugging Face config.json there ({exc})") from None
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise ValueError(f"model {str(path)!r}: config.json lacks {', '.join(missing)}")
    return ModelSpec(
        str(path), c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["vocab_size"],
        c.get("intermediate_size", 0), c.get("num_key_value_heads", 0) or 0, tied=bool(c.get("tie_word_embeddings", False)),
    )


@dataclass(frozen=True)
class Workload:
    """One RL step: prompts × samples sequences of prompt_len + response_len tokens; the updates run
    ppo_epochs × ppo_mini_batches optimizer steps; micro_batch_size sequences per forward pass."""

    prompts_per_step: int = 1024
    samples_per_prompt: int = 1
    prompt_len: int = 1024
    response_len: int = 1024
    ppo_epochs: int = 1
    ppo_mini_batches: int = 1
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"workload {f.name} must be >= 1 (got {getattr(self, f.name)})")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    def batch(self, op: str) -> int:
        """Sequences an op handles: the greedy ops (ReMax's baseline) one per prompt."""
        return self.prompts_per_step if op.endswith("_greedy") else self.prompts_per_step * self.samples_per_prompt


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak reached: forward/prefill and training matmuls (of peak FLOP/s), decode (of
    memory bandwidth), collectives (of link bandwidth), per-layer fixed costs (of the hardware's
    layer_s: 1 means as given); call_s is a fixed cost per role call."""

    forward: float = 0.5
    train: float = 0.4
    decode: float = 0.6
    comm: float = 0.7
    latency: float = 1.0
    call_s: float = 0.02


CATEGORIES = ("forward", "train", "decode", "comm", "latency")


@dataclass(frozen=True)
class Cost:
    """Raw seconds per category at 100 % efficiency, plus the number of role calls."""

    forward: float = 0.0
    train: float = 0.0
    decode: float = 0.0
    comm: float = 0.0
    latency: float = 0.0
    calls: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def seconds(self, eff: Efficiency) -> float:
        return sum(getattr(self, c) / getattr(eff, c) for c in CATEGORIES) + self.calls * eff.call_s


@dataclass(frozen=True)
class Layout:
    """A role's parallel sizes on its devices: pp × tp × dp = devices."""

    pp: int
    tp: int
    dp: int

    @property
    def devices(self) -> int:
        return self.pp * self.tp * self.dp


@dataclass(frozen=True)
class Memory:
    """Bytes per device: static (weights, grads, optimizer state: resident all step) and transient
    (activations or KV cache: alive during one call only)."""

    static: float
    transient: float

    @property
    def peak(self) -> float:
        return self.static + self.transient


def static_memory(model: ModelSpec, layout: Layout, trained: bool, hw: Hardware) -> float:
    """Weights sharded over tp × pp; for trained roles grads too, and fp32 Adam state (plus an fp32
    master copy when weights are narrower) sharded over all devices (a distributed optimizer)."""
    shard = model.params / (layout.tp * layout.pp)
    if not trained:
        return hw.param_bytes * shard
    optim = 8 + (4 if hw.param_bytes < 4 else 0)
    if model.lora_rank:  # frozen base weights; grads and Adam state of the adapters only
        return hw.param_bytes * shard + (hw.param_bytes + optim) * model.trained_params / layout.devices
    return 2 * hw.param_bytes * shard + optim * model.params / layout.devices


def activation_memory(model: ModelSpec, layout: Layout, w: Workload, trained: bool, hw: Hardware) -> float:
    """One micro-batch's activations and fp32 logits; training keeps one micro-batch per pipeline
    stage in flight with layers recomputed (a checkpoint of the hidden state per layer, split over
    tp by sequence parallelism) plus one layer's working set."""
    mbs, s, b = w.micro_batch_size, w.seq_len, hw.param_bytes
    logits = mbs * s * model.vocab * 4 / layout.tp
    if not trained:
        return mbs * s * model.hidden * b * 4 / layout.tp + logits
    in_flight = min(layout.pp, micro_batches(w.batch("train"), layout, w))
    checkpoints = in_flight * mbs * s * model.hidden * b * (model.layers / layout.pp) / layout.tp
    return checkpoints + mbs * s * model.hidden * b * 17 / layout.tp + logits


def kv_bytes_per_seq(model: ModelSpec, gen: Layout, w: Workload, hw: Hardware) -> float:
    return w.seq_len * 2 * model.layers / gen.pp * model.kv_dim / gen.tp * hw.param_bytes


def micro_batches(batch: int, layout: Layout, w: Workload) -> int:
    return max(1, math.ceil(batch / layout.dp / w.micro_batch_size))


def _link(hw: Hardware, group: int, per_node: int) -> float:
    return hw.intra_bw if group <= per_node else hw.inter_bw


def forward_flops(model: ModelSpec, seqs: int, seq_len: int) -> float:
    """2 FLOPs per parameter per token, plus causal attention scores and values."""
    return 2 * model.params * seqs * seq_len + 2 * seqs * seq_len * seq_len * model.hidden * model.layers


def tp_comm(model: ModelSpec, layout: Layout, tokens: float, collectives: int, hw: Hardware, per_node: int) -> float:
    """Tensor-parallel all-reduces: 2 per layer per pass over `tokens` (this dp rank's), ring volume."""
    if layout.tp == 1:
        return 0.0
    nbytes = 2 * model.layers / layout.pp * tokens * model.hidden * hw.param_bytes * 2 * (layout.tp - 1) / layout.tp
    return nbytes / _link(hw, layout.tp, per_node) + 2 * model.layers / layout.pp * collectives * hw.latency_s


def forward_cost(model: ModelSpec, layout: Layout, w: Workload, op: str, hw: Hardware, per_node: int) -> Cost:
    """One pass over the step's sequences (log-probs, values, rewards): compute with the pipeline
    bubble, tensor-parallel all-reduces, and pipeline sends."""
    seqs = w.batch(op)
    m = micro_batches(seqs, layout, w)
    bubble = 1 + (layout.pp - 1) / m
    compute = forward_flops(model, seqs, w.seq_len) / (layout.devices * hw.peak_flops) * bubble
    tokens = seqs / layout.dp * w.seq_len
    comm = tp_comm(model, layout, tokens, m, hw, per_node)
    if layout.pp > 1:
        comm += tokens * model.hidden * hw.param_bytes / layout.tp / hw.intra_bw + (layout.pp - 1) * m * hw.latency_s
    latency = (m + layout.pp - 1) * model.layers / layout.pp * hw.layer_s
    return Cost(forward=compute, comm=comm, latency=latency, calls=1)


def train_cost(model: ModelSpec, layout: Layout, w: Workload, hw: Hardware, per_node: int) -> Cost:
    """ppo_epochs over the batch: forward + backward + recompute (4 forwards of FLOPs), 3 passes of
    tensor-parallel all-reduces, a data-parallel gradient all-reduce and an optimizer step per mini-batch."""
    f = forward_cost(model, layout, w, "train", hw, per_node)
    updates = w.ppo_epochs * w.ppo_mini_batches
    grads = hw.param_bytes * model.trained_params / (layout.tp * layout.pp)
    dp_comm = 0.0
    if layout.dp > 1:
        dp_comm = grads * 2 * (layout.dp - 1) / layout.dp / _link(hw, layout.devices, per_node) + 2 * hw.latency_s * math.log2(layout.dp)
    optimizer = 3 * 16 * model.trained_params / layout.devices / hw.mem_bw
    return Cost(
        train=w.ppo_epochs * 4 * f.forward + updates * optimizer,
        comm=w.ppo_epochs * 3 * f.comm + updates * dp_comm, latency=w.ppo_epochs * 3 * f.latency, calls=1,
    )


def generate_cost(
    model: ModelSpec, train: Layout, gen: Layout, w: Workload, op: str, hw: Hardware, per_node: int, kv_budget: float
) -> Cost | None:
    """Prefill (compute-bound) then response_len decode steps (each reads the weights shard and the
    KV cache: bandwidth-bound), in waves when the KV cache does not fit `kv_budget`; plus the
    3D-HybridEngine transition from the training layout (an all-gather inside each generation
    group's micro data-parallel group). None when one sequence's KV cache does not fit."""
    seqs = w.batch(op)
    per_replica = math.ceil(seqs / gen.dp)
    per_seq = kv_bytes_per_seq(model, gen, w, hw)
    if kv_budget < per_seq:
        return None
    waves = math.ceil(per_replica * per_seq / kv_budget)
    prefill = forward_flops(model, seqs, w.prompt_len) / (gen.devices * hw.peak_flops)
    step_flops = 2 * model.params * per_replica / (gen.tp * gen.pp)
    weights = hw.param_bytes * model.params / (gen.tp * gen.pp)
    kv_read = per_replica * per_seq * (w.prompt_len + w.response_len / 2) / w.seq_len
    decode = w.response_len * (waves * weights + kv_read) / hw.mem_bw
    comm = tp_comm(model, gen, per_replica * (w.prompt_len + w.response_len), w.response_len * waves, hw, per_node)
    shard = hw.param_bytes * model.trained_params / (gen.tp * gen.pp)  # LoRA: only adapters move
    ratio = (train.tp * train.pp) // (gen.tp * gen.pp)
    transition = shard * (ratio - 1) / ratio / _link(hw, train.tp * train.pp, per_node) if ratio > 1 else 0.0
    steps = math.ceil(per_replica / w.micro_batch_size) + w.response_len * waves
    return Cost(
        forward=prefill + w.response_len * step_flops / hw.peak_flops, decode=decode, comm=comm + transition,
        latency=steps * model.layers / gen.pp * hw.layer_s, calls=1,
    )
