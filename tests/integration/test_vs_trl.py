"""`hfrt bench vs-trl`: the token count both sides share, the summary's keys, and the install
hint when TRL is missing (CI does not install trl; the comparison itself is a benchmark)."""

from __future__ import annotations

import subprocess
import sys

from hfrt.bench.vs_trl import INSTALL_HINT, completion_tokens, summarize


def test_completion_tokens_count_up_to_and_including_eos_without_padding() -> None:
    eos, pad = {2}, 0
    rows = [
        [5, 6, 2, 0, 0],  # EOS counted, padding not: 3
        [5, 6, 7, 8, 9],  # cut at the limit: 5
        [2, 0, 0, 0, 0],  # only EOS: 1
        [5, 0, 0, 0, 0],  # padding without EOS ends the row: 1
        [5, 2, 7, 2, 0],  # anything after the first EOS is not a completion token: 2
    ]
    assert completion_tokens(rows, eos, pad) == 12


def test_completion_tokens_when_pad_is_eos() -> None:
    """SmolLM2's pad token is its EOS: the first one counts once, the rest are padding."""
    assert completion_tokens([[4, 2, 2, 2], [2, 2, 2, 2]], {2}, 2) == 3
    assert completion_tokens([[4, 5], []], {2}, None) == 2


def test_summary_keys_and_speedup() -> None:
    ours = [{"wall_s": w, "response_tokens": 32.0, "reward/mean": 0.5, "timing/update_s": 1.0} for w in (9.0, 2.0, 4.0)]
    theirs = [{"step_s": s, "tokens": 32, "generate_s": 1.0} for s in (9.0, 3.0, 5.0)]
    out = summarize({"hfrt": ours, "trl": theirs, "hfrt_ready_s": 1.0, "trl_ready_s": 2.0}, warmup=1)
    assert out["hfrt_step_s"] == 3.0 and out["trl_step_s"] == 4.0
    assert out["speedup"] == round(4.0 / 3.0, 3)
    assert out["hfrt_tokens_per_s"] == 12.0 and out["trl_tokens_per_s"] == 8.5333  # medians of per-step rates
    assert out["hfrt_stages_s"] == {"update_s": 1.0}


def test_without_trl_the_command_says_how_to_install_it() -> None:
    """A real `hfrt bench vs-trl` process in which trl cannot be imported exits 2 with the hint."""
    code = "import sys; sys.modules['trl'] = None; from hfrt.cli import main; sys.exit(main(['bench', 'vs-trl']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert INSTALL_HINT in proc.stderr
    assert "pip install 'hfrt[bench]'" in proc.stderr
