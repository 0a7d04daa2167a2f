"""What a reward function may declare besides (response, ground_truth): the row fields a rollout
carries, the response's token ids and token count (made here from the reward daemon's own tensor
columns), and the reward role's `settings` option as a read-only mapping — plus the check, before
launch, that a function declares nothing else. It knows nothing of the wire, models or flows.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from hfrt.roles.reward_fns import RewardFn, RewardFunctionError

#: Row fields every rollout of hfrt's flows carries (from the data rows and the actor): name → (type, meaning).
ROW_FIELDS: dict[str, tuple[str, str]] = {
    "prompt": ("str | list[dict]", "the prompt as the data gave it: text, or a chat (a list of messages)"),
    "data_source": ("str", "the row's data source (a data file's `data_source`, else the file's name; `addition` for the built-in task)"),
    "extra_info": ("dict", "a data file's `extra_info` object (absent on the built-in task: give it a default)"),
    "uid": ("str", "the prompt's id, shared by its n samples"),
}
#: Made by the reward role from the rollout's `responses` and `attention_mask` tensor columns.
TOKEN_FIELDS: dict[str, tuple[str, str]] = {
    "response_ids": ("list[int]", "the response's token ids, without padding (EOS included when generation stopped on it)"),
    "response_length": ("int", "the response's token count, `len(response_ids)`"),
}
SETTINGS = "settings"
SETTINGS_FIELD: dict[str, tuple[str, str]] = {
    SETTINGS: ("Mapping[str, Any]", "the reward role's `settings` option, read-only (`--set roles.reward.options.settings.KEY=VALUE`)"),
}
#: The first two parameters, passed by position whatever their names.
POSITIONAL: dict[str, tuple[str, str]] = {
    "response": ("str", "the decoded response (first parameter, by position)"),
    "ground_truth": ("Any", "the row's ground truth, \"\" when the data has none (second parameter, by position)"),
}


def may_declare(row_fields: Sequence[str] = ()) -> list[str]:
    """Every name a function may declare after its first two parameters, with a flow's own
    `row_fields` (the reward role option naming the other columns its rollouts carry)."""
    return [*ROW_FIELDS, *row_fields, *TOKEN_FIELDS, SETTINGS]


def declared(fn: RewardFn) -> tuple[list[inspect.Parameter], bool]:
    """The parameters a function declares by name (after its first two positional ones), and
    whether it takes `**info` (every field then). A function without a signature declares none."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], False
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in by_position][:2]
    named = [p for p in params if p not in positional and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_declared(fn: RewardFn, label: str, row_fields: Sequence[str] = ()) -> None:
    """RewardFunctionError naming the function, the first parameter it declares that no sample
    provides, and every name it may declare (run before launch by the reward role's check)."""
    allowed = may_declare(row_fields)
    for param in declared(fn)[0]:
        if param.name in allowed:
            continue
        close = difflib.get_close_matches(param.name, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RewardFunctionError(
            f"reward function {label} declares parameter {param.name!r}{hint}, which the reward role does not give: "
            f"after (response, ground_truth) a reward function may declare {', '.join(allowed)}; name a column "
            "your own flow adds in the reward role's option row_fields, or take **info"
        )


def check_row_fields(value: Any) -> list[str]:
    """The `row_fields` option: a list of column names, none of them a name the reward role gives."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v.isidentifier() for v in value):
        raise ValueError(f"option row_fields={value!r} must be a list of column names (identifiers)")
    taken = sorted(set(value) & {*POSITIONAL, *TOKEN_FIELDS, SETTINGS})
    if taken:
        raise ValueError(f"option row_fields: {taken} are given by the reward role itself, not row fields")
    return list(value)


def read_only(value: Any) -> Any:
    """A copy in which every mapping is a MappingProxyType and every list a tuple (settings a
    function cannot change for the samples after it)."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): read_only(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(read_only(v) for v in value)
    return value


def check_settings(value: Any) -> Mapping[str, Any]:
    """The `settings` option: a table (default empty), returned read-only."""
    if not isinstance(value, Mapping):
        raise ValueError(f"option settings={value!r} must be a table of key = value (e.g. --set roles.reward.options.settings.max_len=12)")
    return read_only(value)


def wanted(fn: RewardFn) -> tuple[set[str], bool]:
    """Which of the reward role's own fields (token fields, settings) fn receives, and whether it
    takes **info (then it receives each of them the batch can give, unasked)."""
    named, var_keyword = declared(fn)
    own = {*TOKEN_FIELDS, SETTINGS}
    return (own if var_keyword else {p.name for p in named} & own), var_keyword


def response_tokens(tensors: Mapping[str, torch.Tensor], where: str) -> list[list[int]]:
    """Each row's response token ids without padding: `responses` where the response part of
    `attention_mask` is 1 (tool outputs of a multi-turn rollout included), else where `response_mask` is."""
    if "responses" not in tensors:
        raise KeyError(f"{where}: the reward function declares response_ids / response_length, which need the tensor "
                       f"column 'responses' (a rollout's); the batch has {sorted(tensors)}")
    responses = tensors["responses"]
    width = int(responses.shape[1])
    mask = tensors.get("attention_mask")
    mask = mask[:, -width:] if mask is not None and mask.shape[1] >= width else tensors.get("response_mask")
    if mask is None:
        raise KeyError(f"{where}: response_ids need 'attention_mask' or 'response_mask' beside 'responses'")
    return [row[keep.bool()].tolist() for row, keep in zip(responses, mask, strict=True)]


def own_fields(
    names: set[str], tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any], rows: int, where: str, *, optional: bool
) -> list[dict[str, Any]]:
    """Per row, the reward role's own fields among `names`. With `optional` (a **info function
    that did not name them) the token fields are left out when the batch has no `responses`."""
    out: list[dict[str, Any]] = [{} for _ in range(rows)]
    if names & set(TOKEN_FIELDS) and not (optional and "responses" not in tensors):
        for one, ids in zip(out, response_tokens(tensors, where), strict=True):
            if "response_ids" in names:
                one["response_ids"] = ids
            if "response_length" in names:
                one["response_length"] = len(ids)
    if SETTINGS in names:
        for one in out:
            one[SETTINGS] = settings
    return out
