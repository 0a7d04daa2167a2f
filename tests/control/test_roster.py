"""The controller's roster through its own interface, without sockets: what a Hello means (refused,
a new process, a replacement, the same process again), who waiting for a role should give up on,
and the lookups the controller makes (by role, by identity, by heartbeat socket)."""

from __future__ import annotations

import pytest

from hfrt.control.roster import Roster
from hfrt.protocols import PROTOCOL_VERSION, Hello
from hfrt.wire.errors import DaemonGone, ProtocolMismatch


def hello(role: str = "actor", rank: int = 0, pid: int = 10, version: int = PROTOCOL_VERSION) -> Hello:
    return Hello(version, role, rank, 2, rank, 2, pid, "host", "impl", {}, {"data": "tcp://h:1"})


def test_a_first_hello_is_fresh_and_registered_with_its_heartbeat_route() -> None:
    roster = Roster()
    verdict = roster.judge_hello("actor:0", hello())
    assert verdict.fresh and verdict.refusal is None and verdict.replaces is None
    info = roster.register("actor:0", hello(), now=3.5)
    assert roster.get("actor:0") is info and info.last_seen == 3.5 and info.alive
    assert roster.of_heartbeat(b"actor:0/hb") is info and roster.of_heartbeat(b"actor:0") is None


def test_the_same_live_process_saying_hello_again_is_not_fresh() -> None:
    roster = Roster()
    roster.register("actor:0", hello(pid=10), 0.0)
    verdict = roster.judge_hello("actor:0", hello(pid=10))
    assert not verdict.fresh and verdict.replaces is None and verdict.refusal is None


def test_a_new_process_under_a_live_identity_replaces_it() -> None:
    roster = Roster()
    old = roster.register("actor:0", hello(pid=10), 0.0)
    verdict = roster.judge_hello("actor:0", hello(pid=11))
    assert verdict.fresh and verdict.replaces is old


def test_a_hello_under_a_gone_identity_is_fresh_and_replaces_nothing() -> None:
    roster = Roster()
    roster.register("actor:0", hello(pid=10), 0.0).alive = False
    for pid in (10, 11):  # the same pid after a restart, or another
        verdict = roster.judge_hello("actor:0", hello(pid=pid))
        assert verdict.fresh and verdict.replaces is None


def test_another_protocol_version_is_refused_and_fails_a_wait_for_its_role() -> None:
    roster = Roster()
    verdict = roster.judge_hello("actor:1", hello(rank=1, version=PROTOCOL_VERSION + 1))
    assert verdict.refusal is not None and verdict.refusal[0] == "ProtocolMismatch"
    assert f"controller speaks {PROTOCOL_VERSION}" in verdict.refusal[1]
    assert not verdict.fresh and roster.get("actor:1") is None
    roster.check_role("critic")  # another role is not concerned
    with pytest.raises(ProtocolMismatch, match="daemon actor:1 was refused: daemon speaks protocol"):
        roster.check_role("actor")


def test_an_identity_that_is_not_its_role_and_rank_is_refused_without_being_remembered() -> None:
    roster = Roster()
    verdict = roster.judge_hello("actor:0", hello(rank=1))
    assert verdict.refusal == ("BadHello", "identity 'actor:0' does not match actor:1")
    roster.check_role("actor")


def test_a_daemon_gone_before_its_hello_keeps_its_first_reason_until_it_says_hello() -> None:
    roster = Roster()
    roster.gone_before_hello("actor:0", "exited: bad option (code 1)")
    roster.gone_before_hello("actor:0", "exit code 1")
    with pytest.raises(DaemonGone, match=r"actor:0 exited before saying hello: exited: bad option \(code 1\); exit code 1"):
        roster.check_role("actor")
    roster.check_role("act")  # a role's name, not a prefix of it
    roster.register("actor:0", hello(), 0.0)
    roster.check_role("actor")


def test_daemons_by_role_come_sorted_by_rank_and_all_in_hello_order() -> None:
    roster = Roster()
    for identity, role, rank in (("critic:0", "critic", 0), ("actor:1", "actor", 1), ("actor:0", "actor", 0)):
        roster.register(identity, hello(role, rank), 0.0)
    assert [d.identity for d in roster.of_role("actor")] == ["actor:0", "actor:1"]
    assert [d.identity for d in roster.of_role(None)] == ["actor:0", "actor:1", "critic:0"]
    assert [d.identity for d in roster.all()] == ["critic:0", "actor:1", "actor:0"]
