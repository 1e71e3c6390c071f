"""CLI dispatch."""

from __future__ import annotations

import pytest

from kvgate.cli import main


def test_bench_takes_its_own_flags_after_the_subcommand(capsys):
    """`kvgate bench --base-url URL ...` reaches the bench parser. Seen to fail with argparse's
    REMAINDER, which answered 'unrecognized arguments: --base-url'."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--base-url", "http://127.0.0.1:9", "--help"])
    assert e.value.code == 0
    assert "--concurrency" in capsys.readouterr().out


def test_python_dash_m_kvgate_runs_the_command():
    """`python -m kvgate` is the `kvgate` command (QA pass 7: "No module named kvgate.__main__").
    Seen red without kvgate/__main__.py."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvgate", "plan", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvgate plan")
