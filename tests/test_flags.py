"""Command-line values out of range are refused before anything loads, naming the flag (exit 2), and a
server whose model cannot load exits instead of staying up. Session 31's QA pass found `--max-queue -1`
killing the engine worker at startup while the process stayed up, `--prefill-chunk 0` killing it at
the first request, `--block-size 0` as a traceback, `--port 99999` listening on 34463, and ten bad
settings each leaving a server up that could never serve.
"""

from __future__ import annotations

import pytest

from kvgate.cli import build_parser

BAD = [
    ("serve", "--max-queue", "-1", "must be at least 0"),
    ("serve", "--prefill-chunk", "0", "must be at least 1"),
    ("serve", "--block-size", "0", "must be at least 1"),
    ("serve", "--max-seqs", "0", "must be at least 1"),
    ("serve", "--threads", "-2", "must be at least 1"),
    ("serve", "--max-ttft", "0", "must be more than 0"),
    ("serve", "--max-queue-wait", "-5", "must be at least 0"),
    ("serve", "--step-timeout", "-1", "must be more than 0"),
    ("serve", "--speculate", "9", "must be from 0 to 8"),
    ("serve", "--max-model-len", "0", "must be at least 2"),
    ("serve", "--port", "99999", "must be from 1 to 65535"),
    ("serve", "--shutdown-grace", "-1", "must be at least 0"),
    ("serve", "--responses-store", "lots", "cannot read 'lots' as a size"),
    ("serve", "--responses-store", "0.5", "not a whole number of bytes"),  # was 0: the store off
    ("serve", "--dtype", "foo", "invalid choice"),
    ("serve", "--weights", "q3", "invalid choice"),
    ("serve", "--prefix-cache", "maybe", "invalid choice"),
    ("plan", "--context", "-5", "must be at least 1"),
    ("generate", "--max-seqs", "x", "is not an integer"),
    ("generate", "--max-tokens", "-1", "must be at least 1"),
    ("cluster", "--replicas", "0", "must be at least 1"),
]


@pytest.mark.parametrize("cmd, flag, value, why", BAD, ids=[f"{c} {f} {v}" for c, f, v, _ in BAD])
def test_an_out_of_range_flag_is_refused_at_the_command_line(cmd, flag, value, why, capsys):
    """Red with the flag's plain int/float/str type back (parsed: no SystemExit)."""
    extra = ["--prompt", "hi"] if cmd == "generate" else []
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([cmd, *extra, flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: " in err and why in err, err


def test_a_bad_environment_value_is_refused_as_the_flag_would_be(monkeypatch, capsys):
    """KVGATE_MAX_SEQS=0 is refused like --max-seqs 0 (it used to be converted unchecked)."""
    monkeypatch.setenv("KVGATE_MAX_SEQS", "0")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan"])
    assert "argument --max-seqs: must be at least 1" in capsys.readouterr().err


def test_the_choices_are_the_resolvers_own():
    """The command line's lists match what placement and the attention modules accept."""
    from kvgate.config import CHOICES
    from kvgate.models import paged_attention, prefill_attention
    from kvgate.models.quant import FORMATS

    assert CHOICES["--weights"] == ("auto", *FORMATS)
    assert CHOICES["--decode-attention"] == paged_attention.CHOICES
    assert CHOICES["--prefill-attention"] == prefill_attention.CHOICES
    from kvgate.core import core_share

    assert CHOICES["--adaptive-threads"] == core_share.CHOICES


def test_a_memory_limit_above_the_machines_memory_is_refused():
    """`kvgate plan --memory-limit 9999TiB` printed a 9999 TiB KV pool with rc 0. Red with the check
    against the device's total taken out."""
    from kvgate.memory.plan import PlanError, resolve_limit

    with pytest.raises(PlanError, match="more than this machine's RAM"):
        resolve_limit("9999TiB", "cpu")
    assert resolve_limit("1GiB", "cpu") == (1 << 30, "explicit")
    with pytest.raises(PlanError, match="must be more than zero"):  # was "not understood" (QA pass 4)
        resolve_limit("-1", "cpu")


def test_a_server_whose_model_cannot_load_exits_1_and_says_why(tmp_path):
    """A KV pool larger than the limit: the error is printed and the process exits 1 within seconds,
    as vLLM and llama-server do, instead of staying up answering 503. Red with the load thread not
    stopping the server (the timeout below)."""
    import os
    import subprocess
    import sys

    from tests.server_util import free_port
    from tests.tiny_model import make_tiny_hf_dir

    d = make_tiny_hf_dir(tmp_path / "m")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_") or k == "KVGATE_EXT_DIR"}
    cmd = [sys.executable, "-m", "kvgate.cli", "serve", "--model", str(d), "--port", str(free_port()),
           "--memory-limit", "1GiB", "--kv-cache-bytes", "100TiB", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "kvgate: error: the model failed to load: --kv-cache-bytes 100.0 TiB does not fit" in p.stderr
