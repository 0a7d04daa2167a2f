"""The endpoint table a daemon sends in `hello`: one typed entry per endpoint, with its parameters.

These records say what the wire carries and refuse anything else (a wrong type, an unknown key or
parameter kind, parameters out of Python's order). They know nothing of inspect, of Python
callables, of dispatch semantics or of how a controller uses the table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class ParamKind(enum.StrEnum):
    """A parameter's kind, as Python's inspect.Parameter.kind names it (lower case)."""

    POSITIONAL_ONLY = "positional_only"
    POSITIONAL_OR_KEYWORD = "positional_or_keyword"
    #: `*args`
    VAR_POSITIONAL = "var_positional"
    KEYWORD_ONLY = "keyword_only"
    #: `**kwargs`
    VAR_KEYWORD = "var_keyword"


#: the order Python requires parameters in (a kind never follows a later one)
_ORDER = {kind: i for i, kind in enumerate(ParamKind)}
#: the keys an entry may carry; a new key is a new protocol version
_ENTRY_KEYS = frozenset({"dispatch", "concurrent", "stream", "params", "keywords"})


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of an endpoint (after `self`). On the wire: `[name, kind, has_default]`.

    name: the parameter's name. kind: a ParamKind. has_default: whether a call may leave it out
    (always False for `*args` / `**kwargs`).
    """

    name: str
    kind: ParamKind
    has_default: bool = False

    def to_wire(self) -> list[Any]:
        return [self.name, self.kind.value, self.has_default]

    @classmethod
    def from_wire(cls, value: object, where: str) -> Param:
        if type(value) is not list or len(value) != 3:
            raise ValueError(f"{where}: expected [name, kind, has_default], got {value!r}")
        name, kind, has_default = value
        if type(name) is not str or not name.isidentifier():
            raise ValueError(f"{where}: parameter name must be an identifier, got {name!r}")
        if type(kind) is not str or kind not in _KINDS:
            raise ValueError(f"{where}: unknown parameter kind {kind!r}; expected one of {', '.join(_KINDS)}")
        if type(has_default) is not bool:
            raise ValueError(f"{where}: has_default must be a bool, got {type(has_default).__name__}")
        return cls(name, ParamKind(kind), has_default)


_KINDS = tuple(k.value for k in ParamKind)


@dataclass(frozen=True, slots=True)
class EndpointEntry:
    """What a daemon says about one endpoint. On the wire a map with these keys:

    dispatch: "replicate" | "split" | "rank0" | "split_generation" (hfrt.wire.endpoints.Dispatch).
    concurrent: whether calls may run beside others. stream: sent (true) only for a streaming
        endpoint.
    params: the parameters after `self`, in order (Param); absent when the daemon does not say,
        and then a controller sends calls unchecked.
    keywords: the names an endpoint taking `**kwargs` accepts there (its options, declared with
        `@endpoint(keywords=...)`); absent: any name. Only with a `var_keyword` parameter.
    """

    dispatch: str
    concurrent: bool = False
    stream: bool = False
    params: tuple[Param, ...] | None = None
    keywords: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.params is not None:
            _check_order(self.params, "params")
        if self.keywords is not None and not any(p.kind is ParamKind.VAR_KEYWORD for p in self.params or ()):
            raise ValueError("keywords: only an endpoint with a **kwargs parameter declares keyword names")

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dispatch": self.dispatch, "concurrent": self.concurrent}
        if self.stream:
            out["stream"] = True
        if self.params is not None:
            out["params"] = [p.to_wire() for p in self.params]
        if self.keywords is not None:
            out["keywords"] = list(self.keywords)
        return out

    @classmethod
    def from_wire(cls, value: object, where: str) -> EndpointEntry:
        """The entry from its wire map; a ValueError names `where` and the bad key."""
        if type(value) is not dict:
            raise ValueError(f"{where}: expected a map, got {type(value).__name__}")
        unknown = sorted(str(k) for k in set(value) - _ENTRY_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(_ENTRY_KEYS)}")
        dispatch = value.get("dispatch")
        if not isinstance(dispatch, str):
            raise ValueError(f"{where}.dispatch: expected str, got {type(dispatch).__name__}")
        concurrent, stream = _flag(value, "concurrent", where, None), _flag(value, "stream", where, False)
        params = _params(value.get("params"), f"{where}.params")
        keywords = _names(value.get("keywords"), f"{where}.keywords")
        try:
            return cls(dispatch, concurrent, stream, params, keywords)
        except ValueError as exc:  # the order of the parameters, keywords without **kwargs
            raise ValueError(f"{where}.{exc}") from None


def read_endpoint_table(value: object, where: str = "hello.endpoints") -> dict[str, EndpointEntry]:
    """Every entry of a hello's endpoint table (name → EndpointEntry), or a ValueError naming the bad one."""
    if type(value) is not dict:
        raise ValueError(f"{where}: expected a map, got {type(value).__name__}")
    table: dict[str, EndpointEntry] = {}
    for name, entry in value.items():
        if type(name) is not str:
            raise ValueError(f"{where}: endpoint names must be str, got {name!r}")
        table[name] = EndpointEntry.from_wire(entry, f"{where}[{name!r}]")
    return table


def _flag(entry: dict[Any, Any], key: str, where: str, default: bool | None) -> bool:
    """entry[key] when it is a bool; `default` when it is absent and may be (None: it must be there)."""
    value = entry.get(key, default)
    if type(value) is not bool:
        raise ValueError(f"{where}.{key}: expected bool, got {type(value).__name__}")
    return bool(value)


def _params(value: object, where: str) -> tuple[Param, ...] | None:
    if value is None:
        return None
    if type(value) is not list:
        raise ValueError(f"{where}: expected an array, got {type(value).__name__}")
    return tuple(Param.from_wire(p, f"{where}[{i}]") for i, p in enumerate(value))


def _names(value: object, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if type(value) is not list or not all(type(n) is str and n.isidentifier() for n in value):
        raise ValueError(f"{where}: expected an array of identifiers, got {value!r}")
    return tuple(value)


def _check_order(params: tuple[Param, ...], where: str) -> None:
    """Unique names, kinds in Python's order, at most one *args and one **kwargs."""
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: duplicate parameter names in {names}")
    kinds = [_ORDER[p.kind] for p in params]
    if kinds != sorted(kinds):
        raise ValueError(f"{where}: parameters out of Python's order: {[p.kind.value for p in params]}")
    for var in (ParamKind.VAR_POSITIONAL, ParamKind.VAR_KEYWORD):
        if sum(p.kind is var for p in params) > 1:
            raise ValueError(f"{where}: more than one {var.value} parameter")
