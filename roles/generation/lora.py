"""Adapter-only weight sync, generation side: generation engines that keep the frozen base weights
they were built with and receive only LoRA adapter tensors, and the actor's hybrid engine that
pushes only those.

- The built-in engine (`AdapterHFGeneration`) injects peft's LoRA layers into its own model copy
  (the same layers the training engine trains through), so a pushed adapter computes exactly what
  training computes; sleep keeps the base (nothing of it is pushed again).
- The vLLM engine (`adapter_vllm_engine`) either runs vLLM's own LoRA (`enable_lora`; the default on
  CUDA): each push is written as a PEFT adapter folder on tmpfs and added under a new LoRARequest id
  (the previous one removed), and every rollout samples through it — or, the default on CPU, where
  vLLM's LoRA path samples several times slower, merges on the receiving side: W = W0 + B·A·alpha/r
  for the adapted modules, W0 read from the model folder, reloaded in place into vLLM.

Adapter tensors travel under PEFT's saved names (`base_model.model.<module>.lora_A.weight`, as in
an adapter folder's adapter_model.safetensors; roles/training/lora.py's saved_name). The LoRA shape
is the `lora` option's LoraSpec (roles/training/lora.py). It knows peft, vLLM's LoRA API and the
GenerationEngine contract; nothing of training engines' internals, flows or the wire.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfrt.roles.generation.grammar import Grammars
from hfrt.roles.generation.hf import HFGenerationEngine
from hfrt.roles.generation.hybrid import HybridEngine
from hfrt.roles.training import lora
from hfrt.roles.training.lora import LoraSpec

#: vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_spec(context: Any) -> LoraSpec | None:
    """A generating role's `lora` option read (None when unset), errors naming roles.<role>.options.lora."""
    return LoraSpec.read(context.options.get("lora"), f"roles.{context.role}.options.lora")


def check_record(record: Mapping[str, Any] | None, spec: LoraSpec | None, where: str) -> None:
    """A sync record's adapter shape must be what this engine was built for; a full-weight sync
    into an adapter engine (or the reverse) is refused, naming the option to set."""
    if record is None and spec is None:
        return
    if record is None:
        raise ValueError(f"{where}: built for LoRA adapters (options.lora), but the sync holds full weights: "
                         "the actor trains without LoRA; remove options.lora here or set the actor's")
    if spec is None:
        raise ValueError(f"{where}: the actor trains LoRA adapters ({record}) and syncs only those; set this "
                         "role's options.lora to the actor's (rank, alpha, target_modules)")
    mine = spec.record()
    differ = [key for key in ("rank", "alpha", "target_modules") if record.get(key) != mine[key]]
    if differ:
        raise ValueError(f"{where}: the actor's adapters are {record}; this role's options.lora is {mine} "
                         f"({', '.join(differ)} differ): set them alike")


# ------------------------------------------------------------------------------ built-in engine


class AdapterHFGeneration(HFGenerationEngine):
    """The built-in engine over a base model copy with peft's LoRA layers injected (B = 0 until the
    first push). load_weights takes adapter tensors only; sleep / wake keep everything (the base is
    never pushed again; the adapters are a few MB)."""

    def __init__(self, model: nn.Module, spec: LoraSpec, *, pad_token_id: int, eos_token_id: int | None,
                 device: torch.device | None = None, decode: Callable[[Sequence[int]], str] | None = None,
                 grammars: Grammars | None = None) -> None:
        model = lora.apply(model, dataclasses.replace(spec, dropout=0.0), "generation options.lora")
        super().__init__(model, pad_token_id=pad_token_id, eos_token_id=eos_token_id, device=device, decode=decode, grammars=grammars)
        self.spec = spec
        self.adapters = {lora.saved_name(n): p for n, p in model.named_parameters() if lora.is_adapter(n)}

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """The adapter tensors by PEFT's saved names: what a push replaces (the base never changes)."""
        return dict(self.adapters)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            target = self.adapters.get(lora.saved_name(name))
            if target is None:
                raise KeyError(f"generation model has no LoRA adapter tensor {name!r} (it has e.g. {next(iter(self.adapters))})")
            with torch.no_grad():
                target.copy_(tensor)

    def held(self, layout: list[list[Any]]) -> torch.Tensor:
        """The adapter tensors this engine holds for a sync bucket's layout, packed as the publisher did."""
        return torch.cat([self.adapters[lora.saved_name(row[0])].detach().reshape(-1).view(torch.uint8).cpu() for row in layout])

    @property
    def keeps_weights_asleep(self) -> bool:
        """Always: sleep frees nothing (HybridEngine.current may skip an unchanged version's push)."""
        return True

    def sleep(self) -> None:
        """Nothing to free: the base is kept (adapter sync never pushes it) and adapters are small."""

    def wake(self) -> None:
        """Nothing to allocate (see sleep)."""


# ---------------------------------------------------------------------------------- vLLM engine


def vllm_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_RANKS[-1]}")


def adapter_vllm_engine(config: Any, spec: LoraSpec, *, pad_token_id: int, native: bool | None = None) -> Any:
    """A VLLMGenerationEngine that takes adapter pushes: with vLLM's own LoRA (`native`, the
    default on CUDA) or merged on this side (the default on CPU, where vLLM's LoRA path sampled
    5.5x slower than the base model: 132 s against 24 s for 8 rows of 8 tokens of SmolLM2-135M
    on the 2-core machine). Built here so vllm is imported only when used."""
    from hfrt.roles.generation.vllm_engine import VLLMGenerationEngine

    class AdapterVLLMGeneration(VLLMGenerationEngine):
        """vLLM with `enable_lora`: the base weights are vLLM's own (loaded once from model_dir);
        each push becomes a new LoRA adapter, the only one kept, and every rollout samples with it.
        Sleep (CUDA only) offloads the base to host memory: it is never pushed again."""

        sleep_level = 1

        def __init__(self) -> None:
            self.spec = spec
            self.folder = tempfile.mkdtemp(prefix="hfrt-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            self.request: Any = None
            self._pushes = 0
            super().__init__(config, pad_token_id=pad_token_id)

        def _engine_args(self) -> dict[str, Any]:
            return {"enable_lora": True, "max_lora_rank": vllm_rank(spec.rank), "max_loras": 1}

        def _lora_request(self) -> Any:
            return self.request

        def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
            from vllm.lora.request import LoRARequest

            self._pushes += 1
            folder = Path(self.folder) / f"v{self._pushes}"
            lora.write_adapter_folder(folder, dict(named), spec, config.model_dir)
            request = LoRARequest(f"hfrt-adapter-{self._pushes}", self._pushes, str(folder))
            engine = self.llm.llm_engine
            if not engine.add_lora(request):
                raise RuntimeError(f"vLLM did not add the LoRA adapter in {folder}")
            if self.request is not None:
                engine.remove_lora(self.request.lora_int_id)
                shutil.rmtree(self.request.lora_path, ignore_errors=True)
            self.request = request
            self.llm.reset_prefix_cache()

        def close(self) -> None:
            super().close()
            shutil.rmtree(self.folder, ignore_errors=True)

    class MergedVLLMGeneration(VLLMGenerationEngine):
        """vLLM without LoRA layers: a push merges W0 + alpha/r·B·A here for every adapted module
        (and W0 for the rest of a fused qkv / gate_up group, which vLLM reloads whole) and reloads
        those weights in place; vLLM's layer-wise reload keeps the layers that got nothing. W0
        comes from the model folder's safetensors, memory-mapped (no resident second copy). Sleep
        (CUDA only) offloads the weights to host memory: a push replaces the adapted layers only."""

        sleep_level = 1

        def __init__(self) -> None:
            self.spec = spec
            self.base = BaseWeights(config.model_dir)
            super().__init__(config, pad_token_id=pad_token_id)
            self.groups = fused_groups(self.llm.apply_model(lambda m: dict(getattr(m, "packed_modules_mapping", {})))[0])
            quiet = _QuietMerge()
            logging.getLogger(RELOAD_GAPS_LOGGER).addFilter(quiet)
            self._quiet = quiet

        def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:  # type: ignore[override]
            self._quiet.on = True
            try:
                super().load_weights(merged_weights(dict(named), spec, self.base, self.groups), stable=True)
            finally:
                self._quiet.on = False


    use_native = torch.cuda.is_available() if native is None else native
    engine: Any = AdapterVLLMGeneration() if use_native else MergedVLLMGeneration()
    if use_native:
        atexit.register(shutil.rmtree, engine.folder, True)  # the adapter folders on tmpfs go with the process
    return engine


#: vLLM's layer-wise reload warns about every layer a push left out (vllm_engine.RELOAD_LOGGER)
RELOAD_GAPS_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _QuietMerge(logging.Filter):
    """Drops the "<Layer>: Failed to load weights" warnings while a merged adapter push runs: it
    reloads the adapted layers only, by design."""

    on = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.on and record.msg == "%s: Failed to load weights")


class BaseWeights:
    """The base model's tensors by checkpoint name, read on demand from the folder's safetensors
    files (memory-mapped by safetensors; each read is a fresh tensor)."""

    def __init__(self, model_dir: str) -> None:
        from safetensors import safe_open

        self.handles = [safe_open(str(f), "pt", device="cpu") for f in sorted(Path(model_dir).glob("*.safetensors"))]
        self.where = {key: h for h in self.handles for key in h.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
        if not self.where:
            raise FileNotFoundError(f"{model_dir}: no safetensors weights to merge LoRA adapters into")

    def get(self, name: str) -> torch.Tensor:
        handle = self.where.get(name)
        if handle is None:
            raise KeyError(f"the base model has no tensor {name!r} to merge an adapter into")
        return handle.get_tensor(name)


def fused_groups(packed: Mapping[str, list[str]]) -> dict[str, tuple[str, ...]]:
    """Each checkpoint module name → the names vLLM fuses it with (itself alone when not fused),
    from a vLLM model's packed_modules_mapping ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...})."""
    return {member: tuple(members) for members in packed.values() for member in members}


def merged_weights(adapters: Mapping[str, torch.Tensor], spec: LoraSpec, base: BaseWeights,
                   groups: Mapping[str, tuple[str, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, W0 + alpha/r·B·A) for every adapted module, in module order, plus W0 for
    the unadapted members of a fused group an adapted module belongs to."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        saved = lora.saved_name(name).removeprefix(lora.SAVED_PREFIX)
        module, sep, tail = saved.partition(".lora_")
        if not sep or tail not in ("A.weight", "B.weight"):
            raise KeyError(f"{name!r} is not a LoRA adapter tensor (expected <module>.lora_A.weight / lora_B.weight)")
        pairs.setdefault(module, {})[tail[0]] = tensor
    modules: list[str] = []
    for module in pairs:
        parent, _, leaf = module.rpartition(".")
        for member in groups.get(leaf, (leaf,)):
            full = f"{parent}.{member}" if parent else member
            if full not in modules:
                modules.append(full)
    for module in modules:
        w0 = base.get(f"{module}.weight")
        ab = pairs.get(module)
        if ab is None:
            yield f"{module}.weight", w0
            continue
        if set(ab) != {"A", "B"}:
            raise KeyError(f"{module}: the push holds only lora_{''.join(ab)} of its adapter")
        delta = (ab["B"].float() @ ab["A"].float()) * spec.scale
        yield f"{module}.weight", (w0.float() + delta.to(w0.device)).to(torch.float32)


# ----------------------------------------------------------------------------------- hybrid


def adapter_tensors(train: Any) -> Iterator[dict[str, torch.Tensor]]:
    """The training engine's adapter tensors as one bucket (collective on sharded engines: every
    rank must exhaust it), under PEFT's saved names."""
    yield {lora.saved_name(name): tensor for name, tensor in train.adapter_state_dict().items()}


class AdapterHybrid(HybridEngine):
    """The hybrid engine with LoRA on the actor: to_generate pushes the adapter tensors only (the
    generation engine holds the frozen base since it was built; `reshard/pushed_mb` counts the
    adapters), skipped as HybridEngine skips an unchanged version."""

    def weights(self) -> Iterator[dict[str, torch.Tensor]]:
        return adapter_tensors(self.train)
