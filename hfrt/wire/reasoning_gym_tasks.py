"""reasoning-gym's procedural tasks as prompt rows and their scorer, shared by both sides: the
controller turns `reasoning_gym:TASK` and its config into rows, and the reward daemon rebuilds a
row's entry from the three facts the row carries (task, config, index) and scores the response with
the task's own `score_answer`, so nothing but those facts crosses the wire.

reasoning-gym is imported on first use (it imports no torch). It knows nothing of flows, roles,
handles or sockets.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: `data = "reasoning_gym:TASK"` (a registered task, `composite`, or a composite's YAML file)
PREFIX = "reasoning_gym:"
#: the `extra_info` keys a row carries to the reward daemon: task name, config (JSON), entry index
TASK_KEY, CONFIG_KEY, INDEX_KEY = "reasoning_gym_task", "reasoning_gym_config", "reasoning_gym_index"
#: data_options hfrt reads itself; every other key is the task's own config
OWN_OPTIONS = ("system_prompt",)
#: the system prompt by default: reasoning-gym's "default" (think, then `<answer>...</answer>`)
DEFAULT_SYSTEM_PROMPT = "default"
#: validation rows come from seed + VAL_SEED_OFFSET (every explicit seed in the config moved by it)
VAL_SEED_OFFSET = 7919
COMPOSITE = "composite"


class GymTaskError(ValueError):
    """A reasoning-gym task that cannot be used, naming the task, the key and what was wrong."""


@dataclass(frozen=True)
class GymSpec:
    """One reasoning-gym dataset: the task's registered name, its config as JSON-able values (size
    and seed included; a composite's `datasets` as reasoning-gym's list of {name, weight, config})
    and the system prompt stating the answer format."""

    task: str
    config: dict[str, Any]
    system_prompt: str

    @property
    def config_json(self) -> str:
        """The config as the rows carry it (sorted keys: the same config is the same text)."""
        return json.dumps(self.config, sort_keys=True)

    @property
    def size(self) -> int:
        return int(self.config["size"])

    def for_validation(self, count: int) -> GymSpec:
        """The same task from seeds the training rows never use (seed + VAL_SEED_OFFSET, and each
        composite part's explicit seed moved the same way), `count` rows."""
        config = dict(self.config, seed=int(self.config["seed"]) + VAL_SEED_OFFSET, size=count)
        if self.task == COMPOSITE:
            config["datasets"] = [_shift_part(part, count) for part in config["datasets"]]
        return GymSpec(self.task, config, self.system_prompt)


def _shift_part(part: Mapping[str, Any], count: int) -> dict[str, Any]:
    inner = dict(part.get("config") or {})
    if "seed" in inner:
        inner["seed"] = int(inner["seed"]) + VAL_SEED_OFFSET
    if "size" in inner:
        inner["size"] = count
    return {**part, "config": inner}


def is_gym(data: str) -> bool:
    return data.startswith(PREFIX)


def parse(data: str, options: Mapping[str, Any], *, seed: int) -> GymSpec:
    """The spec `data` ("reasoning_gym:TASK") and `options` (the task's config keys, size and seed
    among them, plus system_prompt) name, checked by building the dataset once; GymTaskError names
    the task and the problem. `seed` (the run's) is the data seed unless options give one."""
    name = data[len(PREFIX):] if is_gym(data) else data
    own = {k: options[k] for k in OWN_OPTIONS if k in options}
    config = {k: v for k, v in options.items() if k not in OWN_OPTIONS}
    if name.endswith((".yaml", ".yml")):
        name, config = COMPOSITE, {**_composite_yaml(name), **config}
    _check_name(name)
    config.setdefault("seed", seed)
    config.setdefault("size", _default_size(name))
    spec = GymSpec(name, json.loads(json.dumps(config)), _system_prompt(own.get("system_prompt", DEFAULT_SYSTEM_PROMPT)))
    _check(spec)
    return spec


def _composite_yaml(path: str) -> dict[str, Any]:
    """A composite config file as reasoning-gym writes them (size, seed, datasets: [{name, weight, config}])."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise GymTaskError(f"reasoning_gym:{path}: no such composite config file")
    loaded = yaml.safe_load(file.read_text())
    if not isinstance(loaded, dict):
        raise GymTaskError(f"reasoning_gym:{path}: a composite config is a table with size, seed and datasets")
    return loaded


def _system_prompt(value: Any) -> str:
    """A reasoning-gym SYSTEM_PROMPTS name ("default", "DeepSeekZero", "simple", "direct",
    "chain_of_draft"), "" for none, or the text itself (anything with a space)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if not isinstance(value, str):
        raise GymTaskError(f"data_options.system_prompt={value!r}: a name of {sorted(SYSTEM_PROMPTS)}, \"\" or the prompt's text")
    if value in SYSTEM_PROMPTS:
        return str(SYSTEM_PROMPTS[value])
    if value == "" or " " in value:
        return value
    raise GymTaskError(f"data_options.system_prompt={value!r}: no such reasoning-gym prompt; use one of "
                       f"{sorted(SYSTEM_PROMPTS)}, \"\" (none) or the prompt's own text")


def _check_name(task: str) -> None:
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise GymTaskError(f"data=reasoning_gym:{task}: reasoning-gym has no task {task!r}{hint}; its {len(DATASETS)} tasks are "
                           "listed by `python -c \"import reasoning_gym.factory as f; print(sorted(f.DATASETS))\"`")


def _check(spec: GymSpec) -> None:
    from reasoning_gym.factory import DATASETS

    where = f"data=reasoning_gym:{spec.task}"
    fields = [f.name for f in dataclasses.fields(DATASETS[spec.task][1])]
    unknown = sorted(set(spec.config) - set(fields))
    if unknown:
        raise GymTaskError(f"{where}: data_options {unknown} are not keys of the task's config; it reads {fields} "
                           f"(and hfrt's own {list(OWN_OPTIONS)})")
    if isinstance(spec.config["size"], bool) or not isinstance(spec.config["size"], int) or spec.config["size"] < 1:
        raise GymTaskError(f"{where}: data_options.size={spec.config['size']!r} must be a positive number of rows")
    try:
        dataset(spec.task, spec.config_json)[0]
    except GymTaskError:
        raise
    except Exception as exc:  # the task's own config checks (asserts, ValueError, TypeError)
        raise GymTaskError(f"{where}: the task refused its config {spec.config}: {type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=32)
def dataset(task: str, config_json: str) -> Any:
    """reasoning-gym's dataset for a task and its config (as JSON), built once per process."""
    import reasoning_gym

    config = json.loads(config_json)
    if task == COMPOSITE:
        from reasoning_gym.composite import DatasetSpec

        parts = config.get("datasets")
        if not isinstance(parts, list) or not parts or not all(isinstance(p, Mapping) and "name" in p for p in parts):
            raise GymTaskError("data=reasoning_gym:composite: data_options.datasets must be a list of "
                               "{name, weight, config} tables (reasoning-gym's composite config)")
        config["datasets"] = [DatasetSpec(name=str(p["name"]), weight=float(p.get("weight", 1.0)), config=dict(p.get("config") or {}))
                              for p in parts]
    return reasoning_gym.create_dataset(task, **config)


def _default_size(task: str) -> int:
    from reasoning_gym.factory import DATASETS

    return int(DATASETS[task][1]().size) if task != COMPOSITE else 500


@functools.lru_cache(maxsize=4096)
def entry(task: str, config_json: str, index: int) -> dict[str, Any]:
    """The dataset's entry at `index` (question, answer, metadata), made once per process."""
    return dict(dataset(task, config_json)[index])


def rows(spec: GymSpec, indices: Sequence[int]) -> dict[str, list[Any]]:
    """Prompt rows for the entries at `indices`: the question as a chat after the system prompt,
    the entry's answer as ground truth, `reasoning_gym:SOURCE` as data source (a composite's part),
    and the facts the reward daemon rebuilds the entry from, in extra_info."""
    text = spec.config_json
    out: dict[str, list[Any]] = {"prompt": [], "ground_truth": [], "data_source": [], "extra_info": []}
    for index in indices:
        item = entry(spec.task, text, int(index))
        chat = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
        out["prompt"].append([*chat, {"role": "user", "content": str(item["question"])}])
        out["ground_truth"].append(str(item["answer"]))
        source = item.get("metadata", {}).get("source_dataset", spec.task)
        out["data_source"].append(f"{PREFIX}{source}")
        out["extra_info"].append({TASK_KEY: spec.task, CONFIG_KEY: text, INDEX_KEY: int(index)})
    return out


def carries_entry(extra_info: Any) -> bool:
    """Whether a row's extra_info names a reasoning-gym entry."""
    return isinstance(extra_info, Mapping) and TASK_KEY in extra_info


def extract_answer(response: str) -> str | None:
    """The text of the response's last `<answer>...</answer>`, or None (reasoning-gym's own extraction)."""
    from reasoning_gym.utils import extract_answer as extract

    return extract(response)


def score(response: str, ground_truth: Any, extra_info: Mapping[str, Any]) -> float:
    """The task's own `score_answer` of the response's last `<answer>...</answer>` (None when it has
    none) against the entry the row names. The entry is rebuilt here; one whose answer is not the
    row's ground truth means another reasoning-gym version made the row, and is an error."""
    if not carries_entry(extra_info):
        raise GymTaskError(f"a reasoning_gym reward needs the row's extra_info keys {TASK_KEY}, {CONFIG_KEY}, {INDEX_KEY} "
                           f"(rows of data=reasoning_gym:TASK carry them); this row has {sorted(extra_info or {})}")
    task, config, index = str(extra_info[TASK_KEY]), str(extra_info[CONFIG_KEY]), int(extra_info[INDEX_KEY])
    item = entry(task, config, index)
    if ground_truth not in (None, "") and str(item["answer"]) != str(ground_truth):
        raise GymTaskError(f"reasoning_gym:{task} entry {index} rebuilt here has answer {item['answer']!r}, the row says "
                           f"{ground_truth!r}: the controller and the reward daemon have different reasoning-gym versions")
    return float(dataset(task, config).score_answer(extract_answer(response), item))
