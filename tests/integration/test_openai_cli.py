"""`hfrt serve-openai` as a user runs it: a real process that starts a rollout daemon, prints its URL,
answers HTTP, and on Ctrl-C (SIGINT) shuts the daemon down and exits 130 (128 + SIGINT, hfrt.signals);
a rollout daemon killed under it is replaced, the server answering 503 with Retry-After meanwhile
(quoted in docs/agents-and-openai.md, hostile load)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support import hfrt_cmd, sigint_default


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_openai_serves_until_ctrl_c(tmp_path: Path) -> None:
    cmd = hfrt_cmd("serve-openai", "--model", "tiny", "--port", "0", "--run-dir", str(tmp_path / "run"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the first line names the URL once the daemon is up
        assert "serving 'tiny' at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url + "/models", timeout=30) as reply:
            assert json.loads(reply.read())["data"][0]["id"] == "tiny"
        body = json.dumps({"prompt": "1+1=", "max_tokens": 3}).encode()
        req = urllib.request.Request(url + "/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as reply:
            out = json.loads(reply.read())
        assert len(out["choices"][0]["token_ids"]) >= 1 and len(out["prompt_token_ids"]) == 4
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert proc.wait(timeout=30) == 130
        assert time.monotonic() - start < 30
        rest = proc.stdout.read()
        assert "stopping after 2 requests, 1 generate_turn calls" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _daemon_pids(parent: int) -> list[int]:
    """The rollout daemon processes `hfrt serve-openai` (pid `parent`) started."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if "daemon" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]


def _stop(proc: subprocess.Popen[str]) -> str:
    """Stop the server (SIGINT) and return the end of its log (for a failed assertion)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    return proc.stderr.read()[-3000:] if proc.stderr is not None else ""


def _post(url: str, body: dict[str, object]) -> tuple[int, str | None]:
    """(status, the Retry-After header) of one request."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, reply.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Retry-After")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_serving_daemon_is_replaced_and_503_says_when_to_retry(tmp_path: Path) -> None:
    cmd = hfrt_cmd("serve-openai", "--model", "tiny", "--port", "0", "--run-dir", str(tmp_path / "run"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving 'tiny' at" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0] + "/completions"
        body = {"prompt": "1+1=", "max_tokens": 2}
        assert _post(url, body)[0] == 200
        [pid] = _daemon_pids(proc.pid)
        os.kill(pid, signal.SIGKILL)
        killed, answers = time.monotonic(), []
        time.sleep(1.0)  # the death is reported (a request already in flight would be held and retried on the replacement)
        while time.monotonic() - killed < 120:
            status, retry = _post(url, body)
            answers.append((status, retry))
            if status == 200:
                break
            time.sleep(0.1)
        back_after = time.monotonic() - killed
        print(f"replaced and answering after {back_after:.1f} s; answers meanwhile: {sorted(set(answers))}")
        assert answers[-1][0] == 200, (answers[-5:], _stop(proc))
        assert answers[:-1] and all(status == 503 and retry == "5" for status, retry in answers[:-1]), sorted(set(answers))
        [new] = _daemon_pids(proc.pid)
        assert new != pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
