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
