"""What a user sees of a run: TensorBoard scalars (read back with TensorBoard's own reader), W&B
records, the progress bar / lines, the Chrome trace of every call of a real PPO run, and the
`hfrt plot` PNG."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.report import MetricsLog

RECORDS = [
    {"step": s, "reward/mean": 0.1 * (s + 1), "kl/mean": 0.01 * s, "perf/tokens_per_s": 100.0 + s,
     "timing/generate_s": 0.5, "timing/stage2_s": 0.25, "timing/old_log_prob_s": 0.1,
     "timing/advantages_s": 0.05, "timing/update_s": 0.75, "note": "text", "flag": True}
    for s in range(4)
]


def scalars_of(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- metrics sinks --------------------------------------------------------------------------------


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    with MetricsLog(str(tmp_path), tensorboard=True, total_steps=4) as log:
        for record in RECORDS:
            log.write(record)
        # flushed per step: readable while the run goes on
        assert scalars_of(tmp_path / "tensorboard", "reward/mean")[-1] == (3, pytest.approx(0.4))
    assert scalars_of(tmp_path / "tensorboard", "kl/mean") == [(s, pytest.approx(0.01 * s)) for s in range(4)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "timing/update_s" in tags and "note" not in tags and "flag" not in tags and "step" not in tags
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_tensorboard_resume_drops_the_steps_rewritten(tmp_path: Path) -> None:
    with MetricsLog(str(tmp_path), tensorboard=True) as log:
        for record in RECORDS:
            log.write(record)
    with MetricsLog(str(tmp_path), tensorboard=True) as log:
        log.truncate(2)
        log.write(RECORDS[2] | {"reward/mean": 9.0})
    assert scalars_of(tmp_path / "tensorboard", "reward/mean") == [
        (0, pytest.approx(0.1)), (1, pytest.approx(0.2)), (2, pytest.approx(9.0))]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_tensorboard_missing_warns_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with MetricsLog(str(tmp_path), tensorboard=True) as log:
        log.write(RECORDS[0])
    assert not (tmp_path / "tensorboard").exists() or not any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_wandb_missing_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="wandb_project='demo'.*pip install wandb"):
        with MetricsLog(str(tmp_path), wandb_project="demo"):
            pass


def test_wandb_logs_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, data: dict[str, float], step: int) -> None:
            calls.append(("log", (step, data)))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kwargs: Any) -> Run:
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLog(str(tmp_path), wandb_project="demo") as log:
        for record in RECORDS[:2]:
            log.write(record)
    assert calls[0] == ("init", {"project": "demo", "dir": str(tmp_path), "name": tmp_path.name})
    logged = [c[1] for c in calls if c[0] == "log"]
    assert [step for step, _ in logged] == [0, 1]
    assert logged[1][1]["reward/mean"] == pytest.approx(0.2) and "note" not in logged[1][1]
    assert calls[-1] == ("finish", None)


# -- progress ---------------------------------------------------------------------------------------


def test_progress_auto_off_a_terminal_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for mode in ("auto", "off"):
        with MetricsLog(str(tmp_path / mode), progress=mode, total_steps=4) as log:
            for record in RECORDS:
                log.write(record)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def test_progress_on_off_a_terminal_prints_a_line_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    with MetricsLog("", progress="on", total_steps=6, start_step=2) as log:
        for record in RECORDS[2:]:
            log.write(record)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3/6  reward 0.300  kl 0.0200  tok/s 102  eta ")
    assert lines[1].startswith("step 4/6") and "eta 0:00:0" in lines[1]


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    with MetricsLog("", progress="auto", total_steps=4) as log:
        for record in RECORDS:
            log.write(record)
    shown = tty.getvalue()
    assert "4/4" in shown and "reward 0.400" in shown and "kl 0.0300" in shown and "tok/s 103" in shown
    assert "eta 0:00:00" in shown


# -- Chrome trace -----------------------------------------------------------------------------------


def test_chrome_events_rows_names_and_statuses(tmp_path: Path) -> None:
    from hfrt.control.trace import END_EVENT, LANE_TID, START_EVENT, CallTrace

    trace = CallTrace(max_spans=5)
    o = trace.origin
    trace.spans.extend([
        ("actor:1", "generate", 1, o + 1.0, o + 3.0, "ok"),
        ("actor:1", "compute_log_prob", 2, o + 2.0, o + 4.0, "ok"),  # queued behind generate: a 2nd row
        ("actor:1", "_hfrt_free", 3, o + 2.5, o + 2.5, "sent"),  # no reply: an instant on the rank's row
        ("critic:0", "update", 4, o + 5.0, o + 6.0, "error"),
        ("actor:1", "update", 5, o + 5.0, o + 5.5, "ok"),  # the first row is free again
    ])
    trace.recorded = 7
    events = json.loads(trace.write(tmp_path / "trace.json").read_text())  # the JSON array format
    assert events[0]["name"] == START_EVENT and events[0]["args"]["wall_clock_origin_s"] == trace.wall_origin
    assert events[-1]["name"] == END_EVENT and events[-1]["args"] == {"spans": 5, "dropped": 2}
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["actor", "critic"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = {e["args"]["call_id"]: e for e in events if e["ph"] in ("X", "i") and e["name"] not in (START_EVENT, END_EVENT)}
    assert [(procs[spans[i]["pid"]], spans[i]["tid"]) for i in (1, 2, 3, 4, 5)] == [
        ("actor", 1), ("actor", 1 + LANE_TID), ("actor", 1), ("critic", 0), ("actor", 1)]
    assert threads[(spans[1]["pid"], 1)] == "rank 1" and threads[(spans[4]["pid"], 0)] == "rank 0"
    assert spans[1]["ph"] == "X" and spans[1]["name"] == "generate"
    assert spans[1]["ts"] == pytest.approx(1e6) and spans[1]["dur"] == pytest.approx(2e6)
    assert spans[3]["ph"] == "i" and "dur" not in spans[3]
    assert spans[4]["args"] == {"call_id": 4, "status": "error"} and spans[4]["cname"] == "terrible"
    assert "cname" not in spans[5]


async def test_controller_records_every_call_it_sends() -> None:
    from hfrt import CallTimeout, RemoteError
    from tests.support import echo_specs, local_cluster

    async with local_cluster(echo_specs(2)) as (ctl, _):
        echo = await ctl.role("echo")
        await echo.ping()  # not recorded: before record_calls
        trace = ctl.record_calls()
        assert await echo.ping() == ["pong", "pong"]
        with pytest.raises(RemoteError):
            await echo.fail.call_one(1)
        with pytest.raises(CallTimeout):
            await echo.block.call_one(0, 1.0, timeout_s=0.2)
        echo.record.broadcast("x")
        got = sorted((s[0], s[1], s[5]) for s in trace.spans)
    assert got == [
        ("echo:0", "block", "timeout"), ("echo:0", "ping", "ok"), ("echo:0", "record", "sent"),
        ("echo:1", "fail", "error"), ("echo:1", "ping", "ok"), ("echo:1", "record", "sent"),
    ]
    for _, _, call_id, sent, settled, status in trace.spans:
        assert call_id > 0 and trace.origin < sent <= settled
        if status == "timeout":
            assert settled - sent >= 0.2


async def test_a_streamed_trace_holds_one_batch_in_memory_and_writes_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording to a file keeps at most a batch of spans in the controller however many calls
    it sends (its memory stays flat over a long run), and the file gets every call."""
    import asyncio

    from hfrt.control import trace as trace_module
    from tests.support import echo_specs, local_cluster

    monkeypatch.setattr(trace_module, "FLUSH_EVERY", 50)
    async with local_cluster(echo_specs(2)) as (ctl, _):
        echo = await ctl.role("echo")
        trace = ctl.record_calls(path=tmp_path / "trace.json")
        most = 0
        for _ in range(20):
            await asyncio.gather(*(echo.ping() for _ in range(25)))  # 50 calls (2 ranks)
            most = max(most, len(trace.spans))
        assert trace.close() == tmp_path / "trace.json"
        recorded = trace.recorded  # the pings, plus the tensor plane's own calls sent without a reply
    assert recorded >= 1000 and most <= 50 and len(trace.spans) == 0
    events = json.loads((tmp_path / "trace.json").read_text())
    calls = [e for e in events if e["ph"] == "X"]
    assert len(calls) == 1000 and {e["name"] for e in calls} == {"ping"}
    assert len({e["args"]["call_id"] for e in calls}) == 1000
    sent = [e for e in events if e["ph"] == "i" and e["args"].get("status") == "sent"]
    assert len(calls) + len(sent) == recorded
    assert events[-1]["name"] == trace_module.END_EVENT and events[-1]["args"] == {"spans": recorded, "dropped": 0}


def test_a_trace_cut_short_still_reads(tmp_path: Path) -> None:
    """No closing bracket and a half-written last event, as a kill mid-write leaves it."""
    from hfrt.control.trace import START_EVENT, CallTrace, read_events

    trace = CallTrace(path=tmp_path / "trace.json")
    for call_id in range(1, 4):
        trace.add("actor:0", "generate", call_id, trace.origin + call_id, "ok")
    trace.flush()  # what a kill -9 leaves: no close()
    text = (tmp_path / "trace.json").read_text()
    (tmp_path / "cut.json").write_text(text + ',\n{"ph":"X","name":"upd')
    for name in ("trace.json", "cut.json"):
        events = read_events(tmp_path / name)
        assert events[0]["name"] == START_EVENT
        assert [e["args"]["call_id"] for e in events if e["ph"] == "X"] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_controller_leaves_a_loadable_trace(tmp_path: Path) -> None:
    """RUN_DIR/trace.json grows while the run goes on; kill -9 of the controller leaves what was
    written loadable (the JSON array format, no closing bracket needed)."""
    import os
    import secrets
    import signal
    import time

    from hfrt.control.trace import END_EVENT, START_EVENT, read_events
    from tests.deploy.conftest import daemon_pids

    marker = f"trace-kill-{secrets.token_hex(4)}"
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "ping", "--run-dir", str(run_dir),
            "--set", "rounds=10000000", "--set", f"roles.echo.options.marker={marker}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _x_events(run_dir / "trace.json") < 100:
            time.sleep(0.2)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in daemon_pids(marker):
            os.kill(pid, signal.SIGKILL)
    events = read_events(run_dir / "trace.json")
    assert events[0]["name"] == START_EVENT and all(e["name"] != END_EVENT for e in events)
    pings = [e for e in events if e["ph"] == "X" and e["name"] == "ping"]
    assert len(pings) >= 100 and all(e["args"]["status"] == "ok" for e in pings)


def _x_events(path: Path) -> int:
    try:
        return path.read_text().count('"ph":"X"')
    except OSError:
        return 0


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real two-step PPO run, shared by the tests that read what it wrote."""
    run_dir = tmp_path_factory.mktemp("obs") / "run"
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--run-dir", str(run_dir), "--set", "steps=2",
            "--set", "val_every=0"]  # the training stages only (the ppo default validates every 100 steps and at the end)
    out = subprocess.run(args, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout)["trace"] == str(run_dir / "trace.json")
    assert out.stderr.count("step 1/2") == 0  # progress "auto" off a terminal: no bar in the log
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ppo_run_trace_has_every_stage_and_stage2_overlaps(ppo_run: Path) -> None:
    events = json.loads((ppo_run / "trace.json").read_text())  # complete: closing bracket and all
    roles = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            spans.setdefault(f"{roles[e['pid']]}.{e['name']}", []).append(e)
    for name in ("actor.generate", "critic.compute_values", "reference.compute_log_prob", "reward.score",
                 "actor.compute_log_prob", "actor.compute_advantages", "actor.update", "critic.update"):
        assert len(spans.get(name, [])) == 2, (name, sorted(spans))
    assert all(e["args"]["status"] == "ok" for group in spans.values() for e in group)
    for step in range(2):
        stage2 = [spans[n][step] for n in ("critic.compute_values", "reference.compute_log_prob", "reward.score")]
        latest_start = max(e["ts"] for e in stage2)
        earliest_end = min(e["ts"] + e["dur"] for e in stage2)
        assert latest_start < earliest_end, f"step {step}: stage-2 calls did not overlap: {stage2}"
        assert spans["actor.generate"][step]["ts"] + spans["actor.generate"][step]["dur"] <= min(e["ts"] for e in stage2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ppo_run_writes_tensorboard_and_plots(ppo_run: Path) -> None:
    records = [json.loads(x) for x in (ppo_run / "metrics.jsonl").read_text().splitlines()]
    rewards = scalars_of(ppo_run / "tensorboard", "reward/mean")
    assert rewards == [(r["step"], pytest.approx(r["reward/mean"])) for r in records]
    out = subprocess.run([sys.executable, "-m", "hfrt", "plot", str(ppo_run)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(ppo_run / "metrics.png")
    assert (ppo_run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- hfrt plot ----------------------------------------------------------------------------------------


def test_hfrt_plot_draws_a_png(tmp_path: Path) -> None:
    lines = [json.dumps(r | {"val/reward_mean": 0.5} if r["step"] == 3 else r) for r in RECORDS]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "rew')  # last line cut short
    out = subprocess.run([sys.executable, "-m", "hfrt", "plot", str(tmp_path), "--out", str(tmp_path / "p" / "m.png")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    png = tmp_path / "p" / "m.png"
    assert out.stdout.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_refuses_a_missing_or_empty_log(tmp_path: Path) -> None:
    from hfrt.plot import plot_run

    with pytest.raises(ValueError, match="metrics.jsonl: no such file"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metric records"):
        plot_run(tmp_path)
    out = subprocess.run([sys.executable, "-m", "hfrt", "plot", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no metric records" in out.stderr
    assert not (tmp_path / "metrics.png").exists()


def test_plot_draws_validation_kl_and_entropy_panels(tmp_path: Path) -> None:
    """A run's records as the trainer writes them (val_before/* in step 0's record, val/* after a
    step, the KL and entropy names the ppo and grpo flows log): every panel is drawn, and the
    validation before training is the point at step 0 (the pass after step s sits at s + 1), as
    docs/flows.md (what a run writes) says."""
    from hfrt.plot import figure, panels

    records = [
        {"step": s, "reward/mean": 0.1 * s, "kl/mean": 0.01 * s, "actor/kl_loss": 0.02 * s, "actor/ppo_kl": 0.001,
         "actor/reward_kl_penalty_coeff": 0.1, "actor/entropy": 5.5 - 0.1 * s, "timing/generate_s": 0.5,
         "timing/update_s": 0.25, "timing/step_s": 0.8,
         **({"val_before/reward_mean": 0.05, "val_before/accuracy": 0.0} if s == 0 else {}),
         **({"val/reward_mean": 0.3 + 0.1 * s, "val/accuracy": 0.25 * s} if s % 2 else {})}
        for s in range(4)
    ]
    drawn = {p.title: p for p in panels(records)}
    assert list(drawn) == ["reward", "validation", "KL", "entropy"]
    assert [line.label for line in drawn["KL"].lines] == ["kl/mean", "actor/kl_loss", "actor/ppo_kl"]  # no coefficient
    assert [line.label for line in drawn["entropy"].lines] == ["actor/entropy"]
    val = {line.label: (line.steps, line.values) for line in drawn["validation"].lines}
    assert val["val/accuracy"] == ([0, 2, 4], [0.0, 0.25, 0.75])
    assert val["val/reward_mean"][0] == [0, 2, 4] and val["val/reward_mean"][1][0] == 0.05

    fig = figure(records, "run")
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles == ["reward", "validation", "KL", "entropy", "step timings"]
    val_ax = fig.axes[1]
    plotted = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in val_ax.get_lines()}
    assert plotted["val/reward_mean"][0][0] == 0 and plotted["val/reward_mean"][1][0] == 0.05  # the step-0 point
    fig.savefig(tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_leaves_out_panels_a_run_has_no_metrics_for() -> None:
    from hfrt.plot import panels

    assert [p.title for p in panels([{"step": 0, "reward/mean": 1.0}, {"step": 1, "reward/mean": 2.0}])] == ["reward"]
    only_before = panels([{"step": 0, "reward/mean": 1.0, "val_before/accuracy": 0.5}])
    assert [(line.label, line.steps, line.values) for line in only_before[1].lines] == [("val/accuracy", [0], [0.5])]
