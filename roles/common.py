"""What every model-holding role daemon shares: reading its options, preparing the process (torch
threads, seed, the role's own torch.distributed group), checking a model fits, and turning any
set-up failure into an error that names the role; plus the save/load endpoints of a role whose
state is one training engine.

Options (DaemonContext.options, JSON) read here: `model`, `dtype`, `engine` (→ EngineConfig),
`seed`, `threads`, `dist_master` ("host:port" of the role's group when world_size > 1),
`memory_limit_mb` (what the fit check compares with; default: memory available now). It knows
nothing of RL losses or of the wire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hfrt.daemon.base import DaemonContext
from hfrt.roles.generation.hf import SamplingParams
from hfrt.roles.models import ModelConfig, check_model_source, load_model, resolve_model_dir
from hfrt.roles.training.engines import (
    BACKENDS,
    EngineConfig,
    OptimConfig,
    TrainEngine,
    build_train_engine,
    init_distributed,
)
from hfrt.roles.training.lora import LoraSpec
from hfrt.wire.endpoints import Dispatch, endpoint

#: Options every role accepts (the tensor plane reads `transfer`, `stage_in_shm`, `inline_max_bytes`).
COMMON_OPTIONS = frozenset(
    {"model", "dtype", "engine", "seed", "threads", "dist_master", "memory_limit_mb",
     "transfer", "stage_in_shm", "inline_max_bytes"}
)
#: Options a cluster placement may write for any role (hfrt.deploy.placement: `parallel` from the
#: spec's tp_size / pp_size); a role that does not read them ignores them rather than refusing.
PLACEMENT_OPTIONS = frozenset({"parallel"})
SHARDED_BACKENDS = ("fsdp2", "deepspeed", "tp")


class RoleSetupError(RuntimeError):
    """A role could not start: the message names the role and rank, then the reason."""


class ModelDoesNotFit(RuntimeError):
    """The model (with what training adds) needs more memory than this daemon has."""


# ------------------------------------------------------------------------------------ options


def check_options(context: DaemonContext, known: Iterable[str]) -> None:
    """Refuse option names the role does not read (a typo would otherwise be silently ignored)."""
    allowed = COMMON_OPTIONS | set(known)
    unknown = sorted(set(context.options) - allowed - PLACEMENT_OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; this role reads {sorted(allowed)}")


def build_dataclass(cls: type[Any], values: Mapping[str, Any], what: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; expected some of {sorted(names)}")
    return cls(**values)


def engine_config(raw: Mapping[str, Any] | None, *, trainable: bool = True) -> EngineConfig:
    """An EngineConfig from the `engine` option (`optim` a nested dict, `betas` a list)."""
    values = dict(raw or {})
    optim = dict(values.pop("optim", {}) or {})
    if "betas" in optim:
        optim["betas"] = tuple(optim["betas"])
    values["optim"] = build_dataclass(OptimConfig, optim, "engine.optim")
    values.setdefault("trainable", trainable)
    config: EngineConfig = build_dataclass(EngineConfig, values, "engine")
    if config.backend not in BACKENDS:
        raise ValueError(f"engine: unknown training backend {config.backend!r}: use one of {', '.join(BACKENDS)}")
    return config


#: the sampling options a generate call takes as keywords (SamplingParams' fields): declared on
#: the endpoints, so the controller refuses a misspelled one before sending the call
SAMPLING_OPTIONS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(base: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any) -> SamplingParams:
    """SamplingParams from the `sampling` option and per-call overrides (stop ids as a list)."""
    values = dataclasses.asdict(base) if isinstance(base, SamplingParams) else dict(base or {})
    values.update(overrides)
    if values.get("stop_token_ids") is not None:
        values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"])
    if values.get("stop_strings") is not None:
        values["stop_strings"] = tuple(str(t) for t in values["stop_strings"])
    if values.get("logit_bias"):  # a table {id: value} (ids as strings from TOML or JSON), or [id, value] pairs
        bias = values["logit_bias"]
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        values["logit_bias"] = {int(k): float(v) for k, v in pairs}
    return build_dataclass(SamplingParams, values, "sampling")  # type: ignore[no-any-return]


#: generation engines a generating role (actor, rollout) can run
GENERATORS = ("hf", "vllm")


def check_generation_options(options: Mapping[str, Any]) -> None:
    """The options every generating role reads: `sampling` (SamplingParams), `generator` and `vllm`."""
    limit = sampling_params(options.get("sampling")).max_prompt_tokens
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"sampling.max_prompt_tokens: expected a positive whole number of tokens or null, got {limit!r}")
    kind = options.get("generator", "hf")
    if kind not in GENERATORS:
        raise ValueError(f"unknown generator {kind!r}: use {' or '.join(GENERATORS)}")
    if not isinstance(options.get("vllm") or {}, dict):
        raise ValueError("option vllm must be a table of VLLMConfig fields")


@dataclass(frozen=True)
class ModelOptions:
    """The model-related options of one role, parsed once in setup; reading them refuses a `model`
    this machine cannot load (models.check_model_source: preset, folder or Hub id)."""

    model: str
    dtype: str
    seed: int
    engine: EngineConfig
    #: options.lora (actor, critic): peft LoRA adapters train instead of the full weights
    lora: LoraSpec | None = None

    @classmethod
    def read(cls, options: Mapping[str, Any], *, trainable: bool, default_backend: str = "local") -> ModelOptions:
        raw = dict(options.get("engine") or {})
        raw.setdefault("backend", default_backend)
        model = str(options.get("model", "tiny"))
        check_model_source(model, int(options.get("seed", 0)))
        return cls(
            model=model,
            dtype=str(options.get("dtype", "float32")),
            seed=int(options.get("seed", 0)),
            engine=engine_config(raw, trainable=trainable),
            lora=LoraSpec.read(options.get("lora"), "options.lora"),
        )


# ------------------------------------------------------------------------------ process set-up


def prepare_process(context: DaemonContext, *, needs_group: bool) -> bool:
    """Torch threads and seeds; join the role's own process group when it has more than one rank
    and its engines need one (sharded training or collectives over the group). True if joined."""
    options = context.options
    threads = int(options.get("threads", 1))
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any parallel work ran
        torch.set_num_interop_threads(max(1, threads))
    seed = int(options.get("seed", 0))
    random.seed(seed + context.rank)
    torch.manual_seed(seed)
    if needs_group and context.world_size > 1:
        host, port = dist_master(context)
        init_distributed(context.rank, context.world_size, host, port)
        return True
    return False


def dist_master(context: DaemonContext) -> tuple[str, int]:
    """Where the role's process group meets: options.dist_master, else $MASTER_ADDR:$MASTER_PORT."""
    raw = context.options.get("dist_master")
    if not raw and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        raw = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if not raw:
        raise ValueError(
            f"world_size {context.world_size} needs the option dist_master (\"host:port\" where the role's "
            "ranks meet; `hfrt controller` assigns one for local runs)"
        )
    host, sep, port = str(raw).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_master {raw!r}: expected \"host:port\"")
    return host, int(port)


def check_backend(context: DaemonContext, config: EngineConfig) -> None:
    """A trainable role with several ranks must shard (the local backend does not sync gradients)."""
    if config.trainable and context.world_size > 1 and config.backend not in SHARDED_BACKENDS:
        raise ValueError(
            f"engine backend {config.backend!r} cannot train with world_size {context.world_size}: "
            f"use one of {', '.join(SHARDED_BACKENDS)}"
        )


def needs_group(context: DaemonContext, *configs: EngineConfig) -> bool:
    return context.world_size > 1 and any(c.backend in SHARDED_BACKENDS or c.trainable for c in configs)


@contextlib.contextmanager
def role_errors(context: DaemonContext, what: str = "setup") -> Iterator[None]:
    """Re-raise any failure as RoleSetupError naming the role, rank and what was being done."""
    try:
        yield
    except RoleSetupError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise RoleSetupError(
            f"role {context.identity}: {what}: the model does not fit in memory ({type(exc).__name__}: {exc})"
        ) from exc
    except Exception as exc:
        raise RoleSetupError(f"role {context.identity}: {what}: {type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------------------ models, memory


def parameter_count(model_dir: Path, *, value_head: bool) -> int:
    """Parameters of the model in `model_dir`, counted on the meta device (nothing is loaded)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = (AutoModel if value_head else AutoModelForCausalLM).from_config(config)
    count = sum(p.numel() for p in model.parameters())
    return count + (config.hidden_size + 1 if value_head else 0)


def training_bytes(params: int, config: EngineConfig, dp_size: int) -> float:
    """fp32 bytes per rank for weights (+ grads + two AdamW states when trainable), by backend."""
    p = 4.0 * params
    sharded = config.backend in SHARDED_BACKENDS
    if not config.trainable:
        return p / dp_size if sharded and (config.backend == "fsdp2" or config.zero_stage == 3) else p
    if config.backend == "fsdp2" or (config.backend == "deepspeed" and config.zero_stage == 3):
        return 4 * p / dp_size
    if config.backend == "deepspeed":
        replicated = 2 if config.zero_stage == 1 else 1  # weights (+ grads on stage 1) stay whole
        return replicated * p + (4 - replicated) * p / dp_size
    return 4 * p


def available_mb(options: Mapping[str, Any]) -> float:
    """options.memory_limit_mb, else free device memory (CUDA) or MemAvailable (CPU)."""
    if options.get("memory_limit_mb") is not None:
        return float(options["memory_limit_mb"])
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free / 2**20
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return float(psutil.virtual_memory().available) / 2**20


def check_fits(context: DaemonContext, opts: ModelOptions, *, value_head: bool = False, extra_copies: int = 0) -> None:
    """Raise ModelDoesNotFit when weights (+ training state, + `extra_copies` full generation
    copies) exceed the memory at hand. Activations are not counted: this is a lower bound."""
    folder = resolve_model_dir(opts.model, opts.seed)
    params = parameter_count(folder, value_head=value_head)
    need = (training_bytes(params, opts.engine, context.world_size) + extra_copies * 4.0 * params) / 2**20
    if opts.lora is not None and opts.engine.trainable:  # frozen base; grads + AdamW of what trains only
        from hfrt.roles.training import lora

        trains = lora.counts(model_config(opts), opts.lora, value_head=value_head)["trainable"]
        frozen = dataclasses.replace(opts.engine, trainable=False)
        need = (training_bytes(params, frozen, context.world_size) + 16.0 * trains + extra_copies * 4.0 * params) / 2**20
    have = available_mb(context.options)
    if need > have:
        raise ModelDoesNotFit(
            f"model {opts.model!r} ({params / 1e6:.1f}M parameters) needs at least {need:.1f} MiB per rank "
            f"for {'training' if opts.engine.trainable else 'inference'} with backend {opts.engine.backend!r}, "
            f"and {have:.1f} MiB are available"
        )


def check_parallel(context: DaemonContext, opts: ModelOptions, where: str | None = None) -> None:
    """Refuse before launch a training tp × pp that the role's world size or its model cannot take
    (the numbers that do not divide, a model without a TP plan, an unknown pipeline schedule).
    Reads the model's config only, never its weights."""
    engine = opts.engine
    where = where or f"roles.{context.role}.options.engine"
    if engine.loss_parallel:
        from hfrt.roles.training.parallel.tp_plan import check_loss_parallel

        check_loss_parallel(model_config(opts), engine.tp, where)
    if engine.sequence_parallel:
        from hfrt.roles.training.parallel import sequence

        sequence.check(model_config(opts), engine.tp, where)
    if engine.tp * engine.pp == 1:
        return
    from hfrt.roles.training.parallel import pipeline, tp_plan

    if engine.tp < 1 or engine.pp < 1 or context.world_size % (engine.tp * engine.pp):
        raise ValueError(f"{where}: tp={engine.tp} × pp={engine.pp} does not divide the role's world_size={context.world_size}")
    virtual = pipeline.stages_per_rank(engine.pp_schedule, engine.pp_stages_per_rank, engine.pp, where)
    config = model_config(opts)
    tp_plan.check_tp(config, engine.tp, where)
    pipeline.check_pp(tp_plan.text_config(config), engine.pp, where, virtual)


def model_config(opts: ModelOptions) -> Any:
    """The transformers config of the role's model (a preset is written out once, if it is not yet)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_dir(opts.model, opts.seed))


def engine_dp_axes(context: DaemonContext, engine: EngineConfig) -> dict[str, list[int]]:
    """A role training at tp × pp > 1 declares its data-parallel coordinate (the ranks of one tp /
    pp group share rows; rank = (pp·dp + dp)·tp + tp); {} otherwise (the context's own dp)."""
    mp = engine.tp * engine.pp
    if mp == 1 or context.world_size % mp:
        return {}
    dp = context.world_size // mp
    return {"dp": [(context.rank // engine.tp) % dp, dp]}


def build_engine(
    context: DaemonContext, opts: ModelOptions, *, value_head: bool = False, extra_copies: int = 0
) -> TrainEngine:
    """Check the backend and the fit, load the model, wrap it in its training engine."""
    check_backend(context, opts.engine)
    check_fits(context, opts, value_head=value_head, extra_copies=extra_copies)
    model = load_model(ModelConfig(opts.model, opts.dtype, value_head=value_head, seed=opts.seed))
    return build_train_engine(model, opts.engine, opts.lora, lora_seed=opts.seed)


def check_lora(opts: ModelOptions, *, value_head: bool = False) -> None:
    """Before launch: options.lora on a backend that trains it, its target_modules matching
    modules of the model (built on the meta device from its config; the error names those it has)."""
    if opts.lora is None:
        return
    from hfrt.roles.training import lora

    lora.check_engine(opts.lora, opts.engine, "options.lora")
    lora.counts(model_config(opts), opts.lora, value_head=value_head)


def close_group(joined: bool) -> None:
    """Leave the role's process group at teardown, if prepare_process joined it (a group that
    another library made, e.g. vLLM's own, is that library's to destroy)."""
    if joined and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class CheckpointEndpoints:
    """`save` / `load` for a role whose state is one training engine (`self.engine`)."""

    engine: Any

    @endpoint(dispatch=Dispatch.REPLICATE)
    def save(self, path: str) -> str:
        """Write a checkpoint folder (each rank its part; replaced atomically); returns its path."""
        return str(self.engine.save(path))

    @endpoint(dispatch=Dispatch.REPLICATE)
    def load(self, path: str) -> dict[str, int]:
        self.engine.load(path)
        return {"steps": self.engine.steps}
