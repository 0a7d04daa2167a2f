"""`hfrt serve-openai` as a user runs it: a real process that starts a rollout daemon, prints its URL,
answers HTTP, and on Ctrl-C (SIGINT) shuts the daemon down and exits 130 (128 + SIGINT, hfrt.signals)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
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
