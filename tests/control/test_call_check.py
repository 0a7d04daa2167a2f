"""Call-site checks against the endpoint table a daemon sends in hello: a misspelled endpoint or
keyword, too many or missing arguments are refused in the controller, with a "did you mean",
before anything is sent. No processes: the table goes through a real Wire and a recording caller
stands in for the controller. (The same refusals with real daemons: tests/integration/test_call_site_checks.py.)
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from hfrt.control.call_check import CallCheck, did_you_mean
from hfrt.control.daemons import DaemonInfo
from hfrt.control.group import RoleGroup
from hfrt.daemon.base import Daemon
from hfrt.protocols import Hello, Wire, new_key, read_endpoint_table
from hfrt.protocols.endpoints import EndpointEntry, Param, ParamKind
from hfrt.wire.endpoints import Dispatch, endpoint, endpoint_table
from hfrt.wire.errors import BadArguments, UnknownEndpoint
from hfrt.wire.loss_options import ADVANTAGE_OPTIONS, accepted_options


class Shapes(Daemon):
    """Endpoints of every parameter shape; the advantage and update ones as the actor declares them."""

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def sleep(self, seconds: float, tag: Any = None) -> float:
        return seconds

    @endpoint(dispatch=Dispatch.RANK0, keywords=ADVANTAGE_OPTIONS)
    def compute_advantages(self, batch: Any, *extra: Any, estimator: str = "gae", **params: Any) -> Any:
        return batch

    @endpoint(dispatch=Dispatch.SPLIT, keywords=accepted_options("actor"))
    def update(self, batch: Any, *extra: Any, **loss: Any) -> Any:
        return batch

    @endpoint
    def anything(self, batch: Any, **options: Any) -> Any:  # **kwargs, no names declared: any keyword
        return batch

    @endpoint
    def exact(self, key: str, /, value: int, *, flag: bool, mode: str = "a") -> None:
        return None


def received_table(cls: type) -> dict[str, dict[str, Any]]:
    """The endpoint table as a controller receives it: in a Hello, packed, signed and unpacked."""
    table = {name: spec.describe() for name, (spec, _) in endpoint_table(cls).items()}
    wire = Wire(new_key())
    hello = wire.unpack(wire.pack(Hello(1, "actor", 0, 1, 0, 1, 1, "h", "shapes", table, {})))
    assert isinstance(hello, Hello)
    return hello.endpoints


class RecordingCaller:
    """Stands in for the controller: records every call a group would send."""

    recovery = None

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, list[Any], dict[str, Any]]] = []

    def submit(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
               timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]:
        self.sent.append((info.identity, endpoint, args, kwargs))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def submit_all(self, infos: list[DaemonInfo], endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                   timeout_s: float | None = None) -> asyncio.Future[Any]:
        return self.submit_each([(info, args, kwargs) for info in infos], endpoint, combine=list)

    def submit_each(self, parts: list[tuple[DaemonInfo, list[Any], dict[str, Any]]], endpoint: str, *,
                    timeout_s: float | None = None, combine: Any = list) -> asyncio.Future[Any]:
        for info, args, kwargs in parts:
            self.submit(info, endpoint, args, kwargs)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(combine([None] * len(parts)))
        return future


def group_of(cls: type, world: int = 2) -> tuple[RoleGroup, RecordingCaller]:
    table = received_table(cls)
    daemons = [DaemonInfo(f"actor:{r}", "actor", r, world, r, world, 100 + r, "h", "shapes", table, 0.0) for r in range(world)]
    caller = RecordingCaller()
    return RoleGroup(caller, "actor", daemons), caller


def check_of(name: str) -> CallCheck:
    check = CallCheck.of(f"actor.{name}", read_endpoint_table(received_table(Shapes))[name])
    assert check is not None
    return check


async def test_a_misspelled_option_is_refused_with_a_suggestion_and_nothing_is_sent() -> None:
    actor, caller = group_of(Shapes)
    with pytest.raises(BadArguments) as info:
        actor.compute_advantages("batch", "scores", estimator="grpo", norm_adv_by_stdd=True)
    message = str(info.value)
    assert "actor.compute_advantages" in message and "'norm_adv_by_stdd'" in message
    assert "did you mean 'norm_adv_by_std'?" in message and "gamma" in message  # and what it accepts
    assert isinstance(info.value, TypeError)  # what Python raises for a bad call, too
    with pytest.raises(BadArguments, match=r"actor\.update got an unexpected keyword argument 'clip_ratio' — did you mean 'clip_ratio_c'"):
        actor.update("batch", clip_ratio=0.2)
    assert caller.sent == []
    await actor.compute_advantages("batch", "scores", estimator="grpo", norm_adv_by_std=False)
    await actor.update("batch", "old", ppo_epochs=2, clip_ratio_high=0.28)
    assert [(who, name) for who, name, _, _ in caller.sent] == [("actor:0", "compute_advantages"), ("actor:0", "update"), ("actor:1", "update")]


async def test_every_adverb_checks_before_sending() -> None:
    actor, caller = group_of(Shapes)
    for send in (actor.sleep, actor.sleep.call, actor.sleep.broadcast, lambda *a, **k: actor.sleep.call_one(1, *a, **k)):
        with pytest.raises(BadArguments, match=r"actor\.sleep got an unexpected keyword argument 'tagg' — did you mean 'tag'\?"):
            send(0.1, tagg="x")
        with pytest.raises(BadArguments, match=r"actor\.sleep\(seconds, tag=…\) takes 2 positional arguments but 3 were given"):
            send(0.1, "x", "y")
        with pytest.raises(BadArguments, match=r"actor\.sleep\(seconds, tag=…\) is missing required argument\(s\) 'seconds'"):
            send(tag="x")
    assert caller.sent == []
    await actor.sleep.call_one(1, 0.1, tag="x")
    assert caller.sent == [("actor:1", "sleep", [0.1], {"tag": "x"})]


def test_an_unknown_endpoint_names_the_role_close_matches_and_every_endpoint() -> None:
    actor, _ = group_of(Shapes)
    with pytest.raises(UnknownEndpoint) as info:
        actor.compute_advantage  # noqa: B018
    assert str(info.value) == (
        "role 'actor' has no endpoint 'compute_advantage' — did you mean 'compute_advantages'? "
        "It has: anything, compute_advantages, describe, exact, ping, sleep, update"
    )
    with pytest.raises(UnknownEndpoint, match=r"no endpoint 'zzz'; it has: anything, compute_advantages"):
        actor.zzz  # noqa: B018
    assert not hasattr(actor, "pnig")  # an AttributeError still


def test_keyword_rules_follow_the_parameter_kinds() -> None:
    anything, exact, ping = check_of("anything"), check_of("exact"), check_of("ping")
    anything.check(["b"], {"whatever": 1, "else": 2})  # **kwargs without declared names: any keyword
    assert exact.shape == "(key, /, value, *, flag, mode=…)"
    exact.check(["k", 1], {"flag": True})
    exact.check(["k"], {"value": 1, "flag": True, "mode": "b"})
    with pytest.raises(BadArguments, match=r"is missing required argument\(s\) 'flag'"):
        exact.check(["k", 1], {})
    with pytest.raises(BadArguments, match=r"'key' is positional-only; give it by position"):
        exact.check([], {"key": "k", "value": 1, "flag": True})
    with pytest.raises(BadArguments, match=r"got multiple values for argument 'value'"):
        exact.check(["k", 1], {"value": 2, "flag": True})
    with pytest.raises(BadArguments, match=r"actor\.ping got an unexpected keyword argument 'bogus'; it takes no keyword arguments"):
        ping.check([], {"bogus": 1})
    with pytest.raises(BadArguments, match=r"actor\.ping\(\) takes 0 positional arguments but 1 were given"):
        ping.check([1], {})
    check_of("compute_advantages").check(["b", "s", "more", "rows"], {})  # *extra takes any number


def test_keywords_are_declared_only_for_a_method_taking_kwargs() -> None:
    def plain(self: Any, batch: Any, gamma: float = 1.0) -> None: ...

    with pytest.raises(TypeError, match=r"endpoint .*plain: keywords= names what its \*\*kwargs accepts; it takes no \*\*kwargs"):
        endpoint(keywords=("gamma",))(plain)
    assert read_endpoint_table(received_table(Shapes))["update"].keywords == tuple(sorted(accepted_options("actor")))


def test_a_table_without_parameters_is_sent_unchecked() -> None:
    """A daemon that declares no parameters (another implementation of the protocol) is called as before."""
    assert CallCheck.of("x.f", EndpointEntry("replicate")) is None


SIGNATURES = [
    "(self)", "(self, a)", "(self, a, b=1)", "(self, a, *rest)", "(self, a, /, b, *, c, d=1)",
    "(self, *, c)", "(self, a=1, **kw)", "(self, a, /, **kw)", "(self, *args, **kw)",
]
CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}), ((1,), {}), ((1, 2), {}), ((1, 2, 3), {}), ((), {"a": 1}), ((1,), {"a": 1}),
    ((1,), {"b": 2}), ((1, 2), {"c": 3}), ((1,), {"b": 2, "c": 3}), ((), {"c": 3}), ((1,), {"zz": 0}),
]


@pytest.mark.parametrize("text", SIGNATURES)
def test_the_check_agrees_with_pythons_own_binding(text: str) -> None:
    """For endpoints that declare no keyword names, a call passes the check exactly when Python
    could bind it (inspect.Signature.bind, as the daemon does)."""
    namespace: dict[str, Any] = {}
    exec(f"def f{text}: pass", namespace)  # noqa: S102 - a signature under test
    signature = inspect.signature(namespace["f"])
    params = tuple(Param(p.name, ParamKind(p.kind.name.lower()), p.default is not p.empty)
                   for p in list(signature.parameters.values())[1:])
    check = CallCheck.of("r.f", EndpointEntry("replicate", params=params))
    assert check is not None
    assert check.shape == text.replace("self, ", "").replace("(self)", "()").replace("=1", "=…")  # as Python prints it
    for args, kwargs in CALLS:
        try:
            signature.bind(None, *args, **kwargs)
            python_ok = True
        except TypeError:
            python_ok = False
        try:
            check.check(args, kwargs)
            ours_ok = True
        except BadArguments:
            ours_ok = False
        assert ours_ok == python_ok, (text, args, kwargs)


def test_did_you_mean_offers_close_spellings_only() -> None:
    assert did_you_mean("norm_adv_by_stdd", ADVANTAGE_OPTIONS) == "did you mean 'norm_adv_by_std'?"
    assert did_you_mean("tempreature", ["temperature", "top_p", "top_k"]) == "did you mean 'temperature'?"
    assert did_you_mean("xyz", ["temperature", "top_p"]) == ""
