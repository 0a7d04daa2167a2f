"""vLLM's CPU communicator segments (/dev/shm/-tp:0-[0-1]-cpushm_*, the same name for every
external-launcher engine) that a killed engine left are removed before the next engine starts,
while the segments a live process has mapped or open are left alone; an engine removes its own at
exit. Real files in /dev/shm, real processes holding them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hfrt.roles.generation.vllm_engine import SHM_DIR, _own_cpushm, remove_stale_cpushm

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this system")

HOLD = textwrap.dedent("""
    import mmap, sys, time
    mapped = open(sys.argv[1], "r+b")
    view = mmap.mmap(mapped.fileno(), 4096)
    mapped.close()  # held by the mapping alone, as vLLM's segments are
    opened = open(sys.argv[2], "rb")  # held by an open descriptor alone
    print("holding", flush=True)
    time.sleep(60)
""")


def segment(tag: str) -> Path:
    path = SHM_DIR / f"-tp:0-[0-1]-cpushm_hfrt-test-{os.getpid()}-{tag}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_stale_segments_are_removed_and_held_ones_kept() -> None:
    stale, mapped, opened = segment("stale"), segment("mapped"), segment("opened")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(mapped), str(opened)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        removed = remove_stale_cpushm()
        assert stale in removed and not stale.exists()
        assert mapped.exists() and opened.exists(), "a segment in use was removed"
    finally:
        holder.kill()
        holder.wait()
    assert {mapped, opened} <= set(remove_stale_cpushm())  # its holder is gone: stale now
    assert not mapped.exists() and not opened.exists()


def test_an_engine_finds_the_segments_it_has_mapped() -> None:
    import mmap

    path = segment("own")
    try:
        with open(path, "r+b") as f:
            view = mmap.mmap(f.fileno(), 4096)
        assert path in _own_cpushm()
        view.close()
        assert path not in _own_cpushm()
    finally:
        path.unlink(missing_ok=True)
