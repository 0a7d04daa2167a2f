"""The heartbeat thread's decisions (Vigil), on a clock the test gives, without sockets or waiting:
when to say hello again to a new controller session, when a daemon is orphaned (silence, or a run's
controller known dead), when it must end itself, and what an echo undoes."""

from __future__ import annotations

from hfrt.daemon.heartbeat import CONTROLLER_DEAD_AFTER, Silence, Vigil

INTERVAL = 1.0


def vigil(*, orphan_timeout_s: float = 60.0, exit_grace_s: float = 10.0, exit_with_controller: bool = False) -> Vigil:
    return Vigil(0.0, orphan_timeout_s=orphan_timeout_s, exit_grace_s=exit_grace_s, exit_with_controller=exit_with_controller)


def test_an_echo_of_another_session_asks_for_one_hello_per_two_intervals() -> None:
    v = vigil()
    assert not v.echo(1.0, "s1", own_session="s1", interval_s=INTERVAL), "our own session: nothing to do"
    assert v.echo(1.0, "s2", own_session="s1", interval_s=INTERVAL), "a new session: say hello again"
    assert not v.echo(2.5, "s2", own_session="s1", interval_s=INTERVAL), "asked already, within 2 intervals"
    assert v.echo(3.1, "s2", own_session="s1", interval_s=INTERVAL), "still not welcomed after 2 intervals: again"
    assert v.echo(3.2, "s3", own_session="s1", interval_s=INTERVAL), "each session counts on its own"


def test_silence_past_the_orphan_timeout_orphans_once_then_forces_an_exit_after_the_grace() -> None:
    v = vigil(orphan_timeout_s=5.0, exit_grace_s=2.0)
    assert v.judge(5.0, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.FINE
    first = v.judge(5.5, welcomed=True, connected=True, interval_s=INTERVAL)
    assert first.silence is Silence.ORPHANED and first.silent_s == 5.5 and not first.controller_dead
    assert first.detail == "no word from the controller for 5.5s"
    assert v.judge(7.0, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.FINE, "told once only"
    assert v.judge(7.6, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.FORCE_EXIT


def test_an_echo_ends_the_orphaning() -> None:
    v = vigil(orphan_timeout_s=5.0, exit_grace_s=2.0)
    assert v.judge(6.0, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.ORPHANED
    v.echo(6.5, "s1", own_session="s1", interval_s=INTERVAL)
    assert v.judge(9.0, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.FINE
    assert v.judge(11.6, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.ORPHANED, "orphaned anew"


def test_no_orphan_timeout_means_silence_alone_never_orphans() -> None:
    v = vigil(orphan_timeout_s=0.0)
    assert v.judge(1e6, welcomed=True, connected=False, interval_s=INTERVAL).silence is Silence.FINE


def test_a_runs_daemon_is_orphaned_when_its_welcomed_controller_is_dead() -> None:
    dead_after = CONTROLLER_DEAD_AFTER * INTERVAL + 0.1
    v = vigil(exit_with_controller=True)
    assert v.judge(dead_after, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.FINE, "only busy"
    assert v.judge(dead_after, welcomed=False, connected=False, interval_s=INTERVAL).silence is Silence.FINE, "never welcomed"
    early = CONTROLLER_DEAD_AFTER * INTERVAL - 0.1
    assert v.judge(early, welcomed=True, connected=False, interval_s=INTERVAL).silence is Silence.FINE, "not silent long enough"
    gone = v.judge(dead_after, welcomed=True, connected=False, interval_s=INTERVAL)
    assert gone.silence is Silence.ORPHANED and gone.controller_dead
    assert gone.detail.startswith(f"its controller is gone (connection closed), no echo for {dead_after:.1f}")


def test_a_killed_controller_is_known_dead_within_one_interval_of_the_kill() -> None:
    # the controller echoes every other beat, two per interval: the last echo is at most an interval old at the kill
    for last_echo in (0.0, INTERVAL / 2, INTERVAL):
        v = vigil(exit_with_controller=True)
        v.echo(last_echo, "s1", own_session="s1", interval_s=INTERVAL)
        killed = INTERVAL
        verdict = v.judge(killed + INTERVAL + 0.01, welcomed=True, connected=False, interval_s=INTERVAL)
        assert verdict.silence is Silence.ORPHANED, f"last echo at {last_echo}: not known dead one interval after the kill"


def test_a_kept_daemon_outlives_a_dead_controller_until_its_orphan_timeout() -> None:
    v = vigil(orphan_timeout_s=60.0, exit_with_controller=False)
    assert v.judge(30.0, welcomed=True, connected=False, interval_s=INTERVAL).silence is Silence.FINE
    assert v.judge(61.0, welcomed=True, connected=False, interval_s=INTERVAL).silence is Silence.ORPHANED


def test_a_beat_waits_while_replies_and_calls_prove_as_much_and_never_longer_than_one_spacing() -> None:
    from hfrt.daemon.heartbeat import Traffic, beat_deferred

    spacing = INTERVAL / 2
    traffic = Traffic()
    assert beat_deferred(traffic, 10.0, spacing) is None, "no exchange yet: beat"
    traffic.sent, traffic.heard = 9.8, 9.9
    assert beat_deferred(traffic, 10.0, spacing) == 9.8 + spacing, "a reply and a call within the spacing: wait"
    traffic.heard = 9.0
    assert beat_deferred(traffic, 10.0, spacing) is None, "replies alone (a stream to a silent controller): beat"
    traffic.sent, traffic.heard = 9.0, 9.9
    assert beat_deferred(traffic, 10.0, spacing) is None, "calls alone (nothing answered yet): beat"
    traffic.sent = traffic.heard = 9.6
    assert beat_deferred(traffic, 10.1, spacing) is None, "the exchange stopped one spacing ago: beat again"


def test_what_the_serving_loop_heard_counts_as_an_echo_and_ends_an_orphaning() -> None:
    v = vigil(orphan_timeout_s=5.0, exit_grace_s=2.0)
    v.heard(4.0)
    assert v.judge(8.5, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.FINE, "heard at 4.0"
    assert v.judge(9.5, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.ORPHANED
    v.heard(3.0)  # older than what it knows: changes nothing
    assert v.last_heard == 4.0
    v.heard(9.6)
    assert v.judge(11.0, welcomed=True, connected=True, interval_s=INTERVAL).silence is Silence.FINE
