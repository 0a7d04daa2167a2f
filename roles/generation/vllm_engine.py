"""The vLLM generation engine: `vllm.LLM` run in this process, fed weights by an in-process stream.

vLLM's engine core is kept in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker) so that
weight pushes are plain tensor copies, never serialised. Weights go in through the worker's
`reload_weights` (layer-wise in-place reload: each vLLM layer is re-processed as soon as all its
checkpoint tensors arrived), fed by an iterator that pulls one training block at a time. Sleep
mode frees weights and KV cache between rollouts where the platform supports it (CUDA); on CPU
vLLM ignores it. It knows nothing of training engines or RL; see roles/generation/hf.py for the
output layout and the GenerationEngine contract.

Shared memory: at TP/PP > 1 on CPU, vLLM's communicator creates /dev/shm segments named after its
init method, which the external launcher makes the same for every engine ("-tp:0-[0-1]-cpushm_*").
A killed engine leaves them (8 MB) and the next one fails with `create shm ... errno 17`, so an
engine removes the segments no live process holds before it starts, and its own at exit.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfrt.roles.generation.hf import SamplingParams, assemble, left_pad


@dataclass(frozen=True)
class VLLMConfig:
    """How the in-process vLLM engine is built (a generating role's `vllm` option; the `#:` comment
    above a field is its description).

    tensor_parallel_size × data_parallel_size > 1 runs vLLM's "external_launcher" executor: this
    process is one vLLM rank of the torch.distributed world already set up (every rank builds its
    LLM together; vLLM creates its TP / DP groups over that world, TP innermost: TP rank = rank %
    tp, DP rank = rank // tp). Weights come as checkpoint-format tensors, one block at a time, and
    vLLM's loaders keep this rank's TP slice (see load_weights); the actor sends only that slice,
    full-shaped (roles/generation/vllm_pieces.py).
    """

    #: a local Hugging Face directory (models.resolve_model_dir); the role sets it from its `model`
    model_dir: str
    #: "float32", "bfloat16", or "auto" (the model's own)
    dtype: str = "auto"
    #: prompt + response tokens per sequence
    max_model_len: int = 1024
    #: share of device memory vLLM may take (CPU: of the KV-cache budget)
    gpu_memory_utilization: float = 0.5
    #: a fixed KV-cache size; null: on a GPU, gpu_memory_utilization decides; on CPU (where vLLM
    #: would take half of RAM) it is sized from the workload, max_num_seqs sequences of
    #: max_model_len tokens (kv_cache_bytes)
    kv_cache_memory_bytes: int | None = None
    #: sequences vLLM runs at once (more queue); a rollout's rows up to this share one batch
    max_num_seqs: int = 32
    #: free weights + KV cache between rollouts (CUDA only; ignored on CPU)
    enable_sleep_mode: bool = True
    #: skip CUDA graphs / torch.compile (faster start, slower decode)
    enforce_eager: bool = True
    #: vLLM's seed (default: the role's `seed` option)
    seed: int = 0
    #: vLLM's TP ranks; the actor sets it from `generation.parallel` when its tp is above 1
    tensor_parallel_size: int = 1
    #: vLLM's DP ranks; the actor sets it from `generation.parallel` when its tp is above 1
    data_parallel_size: int = 1

    @property
    def external_launcher(self) -> bool:
        return self.tensor_parallel_size * self.data_parallel_size > 1


def import_vllm() -> Any:
    """The vllm module in in-process mode, or ImportError with the reason."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    return vllm


def kv_cache_bytes(model_config: dict[str, Any], dtype: str, tokens: int) -> int:
    """Bytes of K and V for `tokens` tokens of a decoder (every layer, every KV head), in `dtype`
    ("auto": the model's own), plus 10% for vLLM's block rounding."""
    heads = int(model_config.get("num_attention_heads", 1))
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
    if dtype == "auto":
        dtype = str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * int(model_config["num_hidden_layers"]) * kv_heads * head_dim * width
    return int(per_token * tokens * 1.1)


def kv_budget(config: VLLMConfig) -> int | None:
    """The KV-cache size to ask vLLM for: the configured one; on CPU without one, what
    max_num_seqs sequences of max_model_len tokens need (vLLM's own CPU default is half of RAM)."""
    if config.kv_cache_memory_bytes is not None or torch.cuda.is_available():
        return config.kv_cache_memory_bytes
    with open(os.path.join(config.model_dir, "config.json")) as f:
        model_config = json.load(f)
    return kv_cache_bytes(model_config, config.dtype, config.max_model_len * config.max_num_seqs)


#: vLLM's layer-wise reload logs this, once per push, for every layer that received no tensor.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedReloadGaps(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" warning for the layers that get no checkpoint
    tensor by design, so a real gap still shows:

    - rotary embeddings: their cos/sin cache is computed from the config, never in a checkpoint,
      and vLLM puts the unchanged cache back;
    - a tied lm_head (`tie_word_embeddings`): its weight is the embedding, which is pushed; the
      engine re-processes the head after every push (_reprocess_tied_layers).
    """

    def __init__(self, tied_head: bool) -> None:
        super().__init__()
        self.tied_head = tied_head

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0] if isinstance(record.args, tuple) else record.args)
        if layer.endswith("RotaryEmbedding"):
            return False
        return not (self.tied_head and layer == "ParallelLMHead")


def _silence_expected_reload_gaps(model_dir: str) -> None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            tied = bool(json.load(f).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        tied = False
    logger = logging.getLogger(RELOAD_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, ExpectedReloadGaps)]:
        logger.removeFilter(old)
    logger.addFilter(ExpectedReloadGaps(tied))


class VLLMGenerationEngine:
    """GenerationEngine over `vllm.LLM`. Build it in the daemon process, after torch is set up."""

    def __init__(self, config: VLLMConfig, *, pad_token_id: int) -> None:
        vllm = import_vllm()
        self.config = config
        self.pad_token_id = pad_token_id
        self._vllm = vllm
        sleep_ok = config.enable_sleep_mode and torch.cuda.is_available()
        parallel: dict[str, Any] = {}
        if config.external_launcher:
            parallel = _external_launcher(config)
            remove_stale_cpushm()
        self.llm = vllm.LLM(
            **parallel,
            **self._engine_args(),
            model=config.model_dir,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_budget(config),
            max_num_seqs=config.max_num_seqs,
            enable_sleep_mode=sleep_ok,
            enforce_eager=config.enforce_eager,
            logprobs_mode="processed_logprobs",
            seed=config.seed,
            # llguidance, compact JSON, objects closed to their listed properties: the HF engine's constraint
            structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True, "disable_additional_properties": True},
        )
        self._cpushm = _own_cpushm() if config.external_launcher else []
        if self._cpushm:
            atexit.register(_unlink, self._cpushm)  # a kill -9 (or os._exit) leaves them to the next engine's start
        self._sleep_mode = sleep_ok
        self._asleep = False
        self._kv_asleep = False
        _silence_expected_reload_gaps(config.model_dir)

    def _engine_args(self) -> dict[str, Any]:
        """More vllm.LLM arguments for a subclass (roles/generation/lora.py: enable_lora)."""
        return {}

    def _lora_request(self) -> Any:
        """The LoRARequest every rollout samples through (None: the base weights alone)."""
        return None

    def close(self) -> None:
        """Remove this engine's shared-memory segments now (a process that ends with os._exit
        skips atexit); the engine keeps working on its mappings."""
        _unlink(self._cpushm)

    # ---- memory
    #: vLLM sleep level: 2 drops weights and KV cache; 1 (an engine whose base is never pushed again,
    #: roles/generation/lora.py) offloads the weights to host memory and back on wake
    sleep_level = 2

    def sleep(self) -> None:
        """Level 2: drop weights and KV cache (weights are pushed again after wake)."""
        if self._sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = self._kv_asleep = True

    def wake(self) -> None:
        """Re-allocate weight memory only; the KV cache comes back just before sampling."""
        if self._sleep_mode and self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep = False

    def _wake_kv(self) -> None:
        if self._sleep_mode and self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False

    # ---- weights
    @property
    def keeps_weights_asleep(self) -> bool:
        """True where sleep keeps the pushed weights (no sleep mode: CPU), so an unchanged version
        need not be pushed again (HybridEngine.current)."""
        return not self._sleep_mode

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False) -> None:
        """Stream (name, full tensor) pairs into the model in place. Call once per push with the
        whole stream: vLLM finalises layers that received nothing at the end of the call.
        stable=True: the tensors stay valid after the next is drawn (the training engine's own
        parameters), so they are not copied on the way — vLLM's loaders copy each one into the
        layer it rebuilds; without it every tensor is copied first (a gather buffer may be reused)."""
        stream = _owned(named, getattr(self.llm.model_config, "dtype", None), copy=not stable)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        self.llm.apply_model(_reprocess_tied_layers)
        self.llm.reset_prefix_cache()

    def model_parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of vLLM's own parameters, by vLLM names (tests, small models only)."""

        def grab(model: torch.nn.Module) -> dict[str, torch.Tensor]:
            return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}

        return self.llm.apply_model(grab)[0]

    # ---- sampling
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> dict[str, torch.Tensor]:
        self._wake_kv()
        sampling = self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=0,
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=dict(params.logit_bias) if params.logit_bias else None,
            structured_outputs=self._structured(params),
        )
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora_request())
        rows, logps = [], []
        for out in outputs:
            for completion in out.outputs:
                rows.append(list(completion.token_ids))
                logps.append(
                    [
                        _picked(entry, tok)
                        for entry, tok in zip(completion.logprobs or [], completion.token_ids, strict=False)
                    ]
                )
        return self._pack(prompts, rows, logps, params.n)

    def _structured(self, params: SamplingParams) -> Any:
        """vLLM's structured outputs for params.json_schema, on the guidance (llguidance) backend with
        compact JSON and closed objects (the engine's structured_outputs_config): what the HF
        engine's constraint (roles/generation/grammar.py) allows."""
        if params.json_schema is None:
            return None
        from vllm.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams(json=dict(params.json_schema))

    def _pack(
        self, prompts: Sequence[Sequence[int]], rows: list[list[int]], logps: list[list[float]], n: int
    ) -> dict[str, torch.Tensor]:
        prompt_ids, prompt_mask = left_pad([list(p) for p in prompts for _ in range(n)], self.pad_token_id)
        width = max(1, max(len(r) for r in rows))
        responses = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(rows), width), dtype=torch.long)
        log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (row, lp) in enumerate(zip(rows, logps, strict=True)):
            responses[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            response_mask[i, : len(row)] = 1
            log_probs[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
        return assemble(prompt_ids, prompt_mask, responses, response_mask, log_probs, n)


def _external_launcher(config: VLLMConfig) -> dict[str, Any]:
    """vLLM's arguments for one rank of a TP × DP engine spread over the torch.distributed world.
    vLLM reuses the initialised default group (vllm.distributed.init_distributed_environment
    skips init_process_group) and reads RANK / LOCAL_RANK from the environment
    (v1/executor/uniproc_executor.py, ExecutorWithExternalLauncher._distributed_args)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("vllm tensor_parallel_size / data_parallel_size > 1 needs torch.distributed initialised (the actor's group)")
    world = dist.get_world_size()
    if config.tensor_parallel_size * config.data_parallel_size != world:
        raise ValueError(
            f"vllm: tensor_parallel_size {config.tensor_parallel_size} × data_parallel_size "
            f"{config.data_parallel_size} must equal the {world} ranks (external_launcher spans the world)"
        )
    rank = dist.get_rank()
    os.environ["RANK"] = str(rank)
    if torch.cuda.is_available():
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    else:
        os.environ.setdefault("LOCAL_RANK", str(rank))
    return {
        "tensor_parallel_size": config.tensor_parallel_size,
        "data_parallel_size": config.data_parallel_size,
        "distributed_executor_backend": "external_launcher",
    }


def _reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Re-run kernel preparation for layers that share a parameter with an earlier layer.

    A tied lm_head receives no checkpoint tensor of its own (its weight *is* the embedding), so
    the layer-wise reload never re-processes it; on CPU that layer keeps a stale pre-packed copy
    of the old embedding. Returns how many layers were re-processed.
    """
    owner: dict[int, torch.nn.Module] = {}
    redone = 0
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        method = getattr(module, "quant_method", None)
        if params and method is not None and any(id(p) in owner for p in params):
            method.process_weights_after_loading(module)
            redone += 1
        for p in params:
            owner.setdefault(id(p), module)
    return redone


def _picked(entry: Any, token: int) -> float:
    """The sampled token's log-prob from one position's {token_id: Logprob} record."""
    if isinstance(entry, dict):
        return float(entry[token].logprob)
    return float(entry)


def _owned(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None, *, copy: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Copy each tensor as it passes (copy=True): vLLM may hold it until its layer is complete,
    while the training engine frees its gather buffer as soon as the next block is requested.
    Floating tensors are cast to vLLM's dtype on the way (fp32 masters into a bf16 engine: the
    narrowing the configured dtype asks for, done once here instead of warned about per tensor by
    vLLM). copy=False passes tensors of the right dtype through as they are (saves ~0.2 s a push
    of SmolLM2-135M in fp32 on 2 CPU cores)."""
    for name, tensor in named:
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            yield name, tensor.detach().to(dtype=dtype, copy=True)
        else:
            yield name, tensor.detach().clone() if copy else tensor.detach()


SHM_DIR = Path("/dev/shm")
#: the segments of vLLM's CPU shared-memory communicator (vllm/distributed/device_communicators/cpu_communicator.py)
CPUSHM_GLOB = "*-cpushm*"


def remove_stale_cpushm(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove vLLM CPU communicator segments that no live process has open or mapped (left by a
    killed engine); returns those removed."""
    files = sorted(shm_dir.glob(CPUSHM_GLOB))
    held = _held(files) if files else set()
    removed = [f for f in files if str(f) not in held and _unlink([f])]
    if removed:
        logging.getLogger(__name__).warning("removed %d stale vLLM shared-memory segment(s): %s", len(removed),
                                            ", ".join(f.name for f in removed))
    return removed


def _held(files: list[Path]) -> set[str]:
    """The paths among `files` that some process has mapped (/proc/PID/maps) or open (/proc/PID/fd)."""
    names, held = {str(f) for f in files}, set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].removesuffix(" (deleted)") in names:
                    held.add(parts[5])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target in names:
                    held.add(target)
        except OSError:  # the process ended, or is not ours to read
            continue
    return held


def _own_cpushm() -> list[Path]:
    """The communicator segments this process has mapped."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {parts[5] for line in lines if len(parts := line.split(None, 5)) == 6}
    return sorted(Path(p) for p in paths if p.startswith(str(SHM_DIR) + "/") and Path(p).match(CPUSHM_GLOB))


def _unlink(paths: list[Path]) -> bool:
    """Remove `paths` (another rank may have removed them first); True when all are gone."""
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return True
