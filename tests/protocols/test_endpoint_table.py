"""The endpoint table in `hello`: entries with their parameters survive the wire, and a malformed
entry (wrong type, unknown key or parameter kind, parameters out of order) refuses the hello,
naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from hfrt.protocols import PROTOCOL_VERSION, EndpointEntry, Hello, Param, ParamKind, UnknownKind, Wire, new_key
from hfrt.protocols.endpoints import read_endpoint_table

ADVANTAGES = EndpointEntry(
    "rank0",
    params=(
        Param("batch", ParamKind.POSITIONAL_OR_KEYWORD),
        Param("extra", ParamKind.VAR_POSITIONAL),
        Param("estimator", ParamKind.KEYWORD_ONLY, has_default=True),
        Param("params", ParamKind.VAR_KEYWORD),
    ),
    keywords=("gamma", "lam", "norm_adv_by_std"),
)


def through_wire(endpoints: dict[str, Any]) -> Hello:
    wire = Wire(new_key())
    hello = wire.unpack(wire.pack(Hello(PROTOCOL_VERSION, "actor", 0, 1, 0, 1, 1, "h", "actor", endpoints, {})))
    assert isinstance(hello, Hello)
    return hello


def test_entries_and_their_parameters_survive_the_wire() -> None:
    streamed = EndpointEntry("replicate", stream=True, params=(Param("context", ParamKind.POSITIONAL_OR_KEYWORD),))
    hello = through_wire({"compute_advantages": ADVANTAGES.to_wire(), "turn": streamed.to_wire()})
    assert read_endpoint_table(hello.endpoints) == {"compute_advantages": ADVANTAGES, "turn": streamed}
    assert hello.endpoints["compute_advantages"]["params"][1] == ["extra", "var_positional", False]


def test_an_entry_without_parameters_is_still_a_valid_hello() -> None:
    """What the table said before it carried parameters: the controller then sends calls unchecked."""
    hello = through_wire({"ping": {"dispatch": "replicate", "concurrent": False}})
    assert read_endpoint_table(hello.endpoints)["ping"] == EndpointEntry("replicate")


def bad(entry_change: dict[str, Any]) -> str:
    entry = ADVANTAGES.to_wire() | entry_change
    wire = Wire(new_key())
    frames = wire.pack(Hello(PROTOCOL_VERSION, "actor", 0, 1, 0, 1, 1, "h", "actor", {"f": entry}, {}))
    with pytest.raises(UnknownKind) as info:
        wire.unpack(frames)
    return str(info.value)


def test_a_malformed_entry_refuses_the_hello_naming_the_field() -> None:
    params = ADVANTAGES.to_wire()["params"]
    assert bad({"params": [["batch", "keyword_or_whatever", False]]}).startswith(
        "hello.endpoints['f'].params[0]: unknown parameter kind 'keyword_or_whatever'; expected one of positional_only")
    assert bad({"params": [["batch", "positional_or_keyword", 1]]}) == (
        "hello.endpoints['f'].params[0]: has_default must be a bool, got int")
    assert bad({"params": [["not a name", "positional_or_keyword", False]]}).startswith(
        "hello.endpoints['f'].params[0]: parameter name must be an identifier")
    assert bad({"params": [params[2], params[0]]}).startswith("hello.endpoints['f'].params: parameters out of Python's order")
    assert bad({"params": [params[0], params[0]]}).startswith("hello.endpoints['f'].params: duplicate parameter names")
    assert bad({"params": params[:3]}) == (
        "hello.endpoints['f'].keywords: only an endpoint with a **kwargs parameter declares keyword names")
    assert bad({"keywords": ["ok", 3]}).startswith("hello.endpoints['f'].keywords: expected an array of identifiers")
    assert bad({"concurrent": "no"}) == "hello.endpoints['f'].concurrent: expected bool, got str"
    assert bad({"signature": "(a, b)"}).startswith("hello.endpoints['f']: unknown key(s) ['signature']")


def test_every_parameter_kind_is_one_of_pythons() -> None:
    import inspect

    assert {k.value for k in ParamKind} == {k.name.lower() for k in type(inspect.Parameter.KEYWORD_ONLY)}
