"""`hfrt serve-openai --record DIR` as a user runs it, then `--flow agent_replay` on what it wrote:
chats through the `openai` client — two without a session (each its own conversation, written at
once), a two-turn session ended with a reward, a session whose reward is POSTed after it was
written, a session given a reward while open and left open at Ctrl-C (written on the way out) —
make one conversations-*.jsonl file of exact trajectories (sampled tokens masked 1, the user's
next turn 0, a log-prob per token, the policy version, the session), and two optimizer steps train
on them, with a reward function for the conversations that have no reward. docs/agents-and-openai.md
describes these files and the flow."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import hfrt_cmd, sigint_default

QUIET = ("--set", "progress=off", "--set", "tensorboard=false", "--set", "trace=false", "--set", "export_hf=false")


def reply_length(answer: str, sample: dict[str, Any]) -> float:
    """The replay test's reward function: shorter replies score higher."""
    return 1.0 / (1.0 + len(answer))


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    reply = httpx.post(url, json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def serve_and_chat(record: Path, run: Path) -> None:
    from openai import OpenAI

    proc = subprocess.Popen(hfrt_cmd("serve-openai", "--model", "tiny", "--port", "0", "--record", str(record), "--run-dir", str(run)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert " at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0]
        client = OpenAI(base_url=url, api_key="none", max_retries=0)
        ask = [{"role": "user", "content": "1+1="}]
        for _ in range(2):  # no session: each request is a conversation of its own
            client.chat.completions.create(model="tiny", messages=ask, max_tokens=3)  # type: ignore[arg-type]
        first = client.chat.completions.create(model="tiny", messages=ask, max_tokens=3, extra_headers={"X-Session-Id": "s1"})  # type: ignore[arg-type]
        again = [*ask, {"role": "assistant", "content": first.choices[0].message.content or ""}, {"role": "user", "content": "2+2="}]
        client.chat.completions.create(model="tiny", messages=again, max_tokens=3, extra_headers={"X-Session-Id": "s1"})  # type: ignore[arg-type]
        assert _post(f"{url}/sessions/s1/end", {"reward": 1.0})["recorded"] is True
        for name in ("s2", "s3"):
            client.chat.completions.create(model="tiny", messages=ask, max_tokens=3, extra_headers={"X-Session-Id": name})  # type: ignore[arg-type]
        _post(f"{url}/sessions/s2/end", {})
        assert _post(f"{url}/sessions/s2/reward", {"reward": 0.5})["status"] == "written"
        assert _post(f"{url}/sessions/s3/reward", {"reward": 0.25})["status"] == "pending"  # s3 stays open
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_served_conversations_are_recorded_and_train(tmp_path: Path) -> None:
    from hfrt.serve.record import read_recorded

    record = tmp_path / "recorded"
    serve_and_chat(record, tmp_path / "serve")
    [file] = sorted(record.glob("conversations-*.jsonl"))
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["trajectory"] * 4 + ["reward", "trajectory"]
    trajectories = [line for line in lines if line["kind"] == "trajectory"]
    sessions = [t["session"] for t in trajectories]
    assert sessions[0].startswith("request-") and sessions[1].startswith("request-") and sessions[2:] == ["s1", "s2", "s3"]
    for t in trajectories:
        assert len(t["response_ids"]) == len(t["gen_mask"]) == len(t["log_probs"]) and t["prompt_ids"]
        assert t["weight_versions"] and t["policy_version"] == -1  # the served model's own weights
        assert all(lp == 0.0 for lp, m in zip(t["log_probs"], t["gen_mask"], strict=True) if not m)
        assert any(lp < 0.0 for lp, m in zip(t["log_probs"], t["gen_mask"], strict=True) if m)
        assert t["messages"][-1]["role"] == "assistant" and t["answer"] == t["messages"][-1]["content"]
    s1 = trajectories[2]
    assert s1["turns"] == 2 and s1["reward"] == 1.0 and 0 in s1["gen_mask"]  # the user's second turn is context
    assert [t["reward"] for t in trajectories] == [None, None, 1.0, None, 0.25]
    assert [t["reward"] for t in read_recorded(record)] == [None, None, 1.0, 0.5, 0.25]  # s2's came later

    missing = subprocess.run(hfrt_cmd("controller", "--flow", "agent_replay", "--set", f"data={record}", *QUIET),
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "2 recorded trajectories have no reward (first: session 'request-" in missing.stderr
    run = tmp_path / "replay"
    done = subprocess.run(hfrt_cmd("controller", "--flow", "agent_replay", "--run-dir", str(run), "--set", f"data={record}",
                                   "--set", "reward_function=tests.integration.test_openai_record:reply_length",
                                   "--set", "rows_per_step=4", "--set", "max_steps=2", *QUIET),
                          capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout[done.stdout.index("{"):])["steps"] == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["actor/grad_norm"] > 0 for r in records)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
