"""Suite fixtures: the suite fails if any hfrt daemon process it started outlives it, and no test
leaves its environment variables to the next."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.support import hfrt_daemon_pids


@pytest.fixture(scope="session", autouse=True)
def no_leaked_daemons() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while hfrt_daemon_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = hfrt_daemon_pids()
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    assert not leaked, f"hfrt daemon processes outlived the test suite: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def own_environment() -> Iterator[None]:
    """Put os.environ back after every test: an import may set variables the daemons later started
    inherit (importing trl sets VLLM_LOGGING_LEVEL=ERROR, which silenced vLLM's engine log in a later
    test that reads it)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
