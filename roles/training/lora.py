"""LoRA adapters on a training engine's model, with peft: the `lora` role option (LoraSpec), peft's
LoRA layers injected in place before the engine shards the model (the model keeps its class, so a
ValueModel stays one), only adapter parameters (and a value model's head) trainable, adapters
switched off for the base model's log-probs, the adapter tensors read out whole, merged full
weights for whoever needs base-model names, a PEFT adapter folder, and the pre-launch checks.

Defaults as verl and OpenRLHF have them: alpha 16, dropout 0,
target_modules "all-linear" (every linear layer but the output head). A value model's adapters
go into its backbone; its scalar head trains in full.

It knows peft, transformers configs and torch.distributed tensors; nothing of daemons, flows,
losses or generation engines.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfrt.roles.models import ValueModel

#: peft's adapter name; in-model adapter tensors are `<module>.lora_A.default.weight`
ADAPTER = "default"
#: PEFT's prefix of saved adapter tensor names (adapter_model.safetensors)
SAVED_PREFIX = "base_model.model."
#: training backends that can train adapters (the TP / pipeline engine cannot yet)
LORA_BACKENDS = ("local", "fsdp2", "deepspeed")
DEFAULT_ALPHA = 16.0
DEFAULT_TARGETS = "all-linear"
_KEYS = frozenset({"rank", "alpha", "dropout", "target_modules"})


@dataclass(frozen=True)
class LoraSpec:
    """A role's `lora` option (the `#:` comment above a field is its description)."""

    #: the adapters' rank r (required: there is no LoRA without one)
    rank: int
    #: the update is B·A·alpha/r
    alpha: float = DEFAULT_ALPHA
    #: dropout on the adapters' input while training
    dropout: float = 0.0
    #: module names (peft matches each as a name or a dotted-name suffix) or "all-linear"
    target_modules: str | tuple[str, ...] = DEFAULT_TARGETS

    @classmethod
    def read(cls, raw: Any, where: str) -> LoraSpec | None:
        """The `lora` option (a table) read and checked; None when absent. Errors name `where`."""
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a table {{rank, alpha, dropout, target_modules}}, got {raw!r}")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {sorted(_KEYS)}")
        rank = raw.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"{where}.rank must be an integer > 0, got {rank!r}")
        alpha = raw.get("alpha", DEFAULT_ALPHA)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
            raise ValueError(f"{where}.alpha must be a number > 0, got {alpha!r}")
        dropout = raw.get("dropout", 0.0)
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
            raise ValueError(f"{where}.dropout must be a number in [0, 1), got {dropout!r}")
        targets = raw.get("target_modules", DEFAULT_TARGETS)
        if isinstance(targets, str):
            if not targets:
                raise ValueError(f"{where}.target_modules is empty: give module names or \"all-linear\"")
        elif isinstance(targets, list | tuple) and targets and all(isinstance(t, str) and t for t in targets):
            targets = tuple(targets)
        else:
            raise ValueError(f"{where}.target_modules must be \"all-linear\" or a non-empty list of module names, got {targets!r}")
        return cls(rank, float(alpha), float(dropout), targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def record(self) -> dict[str, Any]:
        """The spec as plain data (msgpack / JSON): what a sync record and a checkpoint carry."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "target_modules": targets}

    def peft_config(self, *, base: str | None = None) -> Any:
        """peft's LoraConfig for this spec (task CAUSAL_LM; `base`: base_model_name_or_path)."""
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        alpha = int(self.alpha) if self.alpha.is_integer() else self.alpha  # peft types it int; a float scales alike
        return LoraConfig(r=self.rank, lora_alpha=alpha, lora_dropout=self.dropout, target_modules=targets,  # type: ignore[arg-type]
                          bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base)


# ------------------------------------------------------------------------------------ the model


def adapted_part(model: nn.Module) -> nn.Module:
    """Where adapters go: a value model's backbone, else the model itself."""
    return model.backbone if isinstance(model, ValueModel) else model


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear modules (what target_modules may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and name})


def apply(model: nn.Module, spec: LoraSpec, where: str = "options.lora", *, seed: int = 0) -> nn.Module:
    """Inject peft's LoRA layers into `model` in place (before any sharding) and leave only the
    adapters — and a value model's head — trainable. A's random init is drawn from `seed`, so
    every rank of a sharded engine starts from the same adapters (B starts at 0). A target that
    matches nothing is refused, naming the linear modules the model has."""
    from peft import inject_adapter_in_model

    part = adapted_part(model)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(spec.peft_config(), part, adapter_name=ADAPTER)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError and friends
        raise ValueError(
            f"{where}.target_modules={spec.record()['target_modules']!r} matches no module of the model "
            f"({exc}); its linear modules are {linear_module_names(part)}"
        ) from None
    if isinstance(model, ValueModel):
        model.value_head.requires_grad_(True)
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within: every LoRA layer computes its base layer alone, i.e. the base model's outputs (the
    reference policy). Sets peft's per-layer flag rather than calling enable_adapters, which would
    also flip requires_grad on parameters a sharding wrapper already registered."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, old in zip(layers, before, strict=True):
            m._disable_adapters = old


def saved_name(name: str) -> str:
    """peft's in-model name of an adapter tensor → its name in a PEFT adapter file
    (`base_model.model.<module>.lora_A.weight`): the adapter name dropped, the prefix added."""
    for part in (".lora_A.", ".lora_B."):
        head, sep, tail = name.partition(part)
        if sep and tail == f"{ADAPTER}.weight":
            name = f"{head}{sep}weight"
    return name if name.startswith(SAVED_PREFIX) else SAVED_PREFIX + name


# ------------------------------------------------------------------------------ reading tensors


def full_tensors(named: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Whole copies of (possibly sharded) parameters: DTensor shards gathered, DeepSpeed ZeRO-3
    partitions gathered (collective on sharded engines: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    ds_params = [p for _, p in named if hasattr(p, "ds_id")]
    gather: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if ds_params:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(ds_params, modifier_rank=None)
    with gather:
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p.data).detach().clone() for n, p in named}


def merged_bucket(bucket: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A gathered bucket of an adapted model as the plain model's names and weights: each
    `<m>.base_layer.weight` becomes `<m>.weight` = W + alpha/r · B·A, adapters dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in bucket.items():
        if is_adapter(name):
            continue
        head, sep, tail = name.partition(".base_layer.")
        if not sep:
            out[name] = tensor
            continue
        if tail == "weight":
            a, b = bucket.get(f"{head}.lora_A.{ADAPTER}.weight"), bucket.get(f"{head}.lora_B.{ADAPTER}.weight")
            if a is None or b is None:
                raise KeyError(f"{name}: its LoRA A / B tensors are not in the same bucket")
            delta = (b.float() @ a.float()) * spec.scale
            tensor = (tensor.float() + delta).to(tensor.dtype)
        out[f"{head}.{tail}"] = tensor
    return out


def merged_buckets(buckets: Iterable[Mapping[str, torch.Tensor]], spec: LoraSpec) -> Iterator[dict[str, torch.Tensor]]:
    for bucket in buckets:
        yield merged_bucket(bucket, spec)


def write_adapter_folder(folder: Path, adapters: Mapping[str, torch.Tensor], spec: LoraSpec, base: str) -> Path:
    """A PEFT adapter folder (adapter_config.json by peft's LoraConfig, adapter_model.safetensors)
    that `peft.PeftModel.from_pretrained(base_model, folder)` and vLLM's LoRA loader read."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    spec.peft_config(base=base).save_pretrained(str(folder))
    save_file({saved_name(n): t.detach().contiguous().cpu() for n, t in adapters.items()},
              str(folder / "adapter_model.safetensors"))
    return folder


def check_saved_state(model: nn.Module, state: Mapping[str, Any], where: str) -> None:
    """A LoRA checkpoint holds exactly the trainable parameters (adapters, a value head)."""
    want, have = set(trainable_names(model)), set(state)
    if want != have:
        raise ValueError(f"{where}: LoRA checkpoint tensors do not match this model's adapters: "
                         f"missing {sorted(want - have)[:4]}, unexpected {sorted(have - want)[:4]}")


# ---------------------------------------------------------------------------------- before launch


def check_engine(spec: LoraSpec | None, engine: Any, where: str) -> None:
    """LoRA needs a backend that trains it: local, fsdp2 or deepspeed with tp = pp = 1."""
    if spec is None:
        return
    if engine.backend not in LORA_BACKENDS or engine.tp * engine.pp > 1:
        raise ValueError(
            f"{where}: LoRA adapters train on the {', '.join(LORA_BACKENDS)} backends with tp = pp = 1; this role's "
            f"engine is backend={engine.backend!r}, tp={engine.tp}, pp={engine.pp}: use fsdp2 or deepspeed "
            "(LoRA's small optimizer state rarely needs tensor / pipeline parallelism), or drop options.lora"
        )


def meta_model(model_config: Any, *, value_head: bool) -> nn.Module:
    """The role's model built on the meta device from its config (nothing allocated or loaded)."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        if value_head:
            backbone = AutoModel.from_config(model_config)
            return ValueModel(backbone, model_config.hidden_size)
        return AutoModelForCausalLM.from_config(model_config)


def counts(model_config: Any, spec: LoraSpec, *, value_head: bool, where: str = "options.lora") -> dict[str, int]:
    """{"parameters", "trainable", "adapter"} of the model with these adapters, on the meta device;
    raises what `apply` raises (a target that matches nothing)."""
    model = apply(meta_model(model_config, value_head=value_head), spec, where)
    return {
        "parameters": sum(p.numel() for n, p in model.named_parameters() if not is_adapter(n)),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "adapter": sum(p.numel() for _, p in adapter_parameters(model)),
    }


def describe(spec: LoraSpec) -> str:
    return json.dumps(spec.record())
