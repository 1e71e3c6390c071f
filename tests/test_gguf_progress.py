"""A first GGUF conversion reports its progress: log lines when stderr is not a terminal, a bar when it is.

Seen to fail: with the start log line of `_Progress` reworded, the non-terminal test went red; with
the bar's closing newline removed, the terminal test did.
"""

from __future__ import annotations

import io
import logging

from gguf import GGUFReader

from kvgate.models import gguf_loader
from tests.tiny_gguf import write_tiny_gguf


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_first_conversion_logs_its_size_and_time_and_a_cached_load_logs_nothing(
    tmp_path, monkeypatch, caplog, capsys
):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    n = len(GGUFReader(str(path)).tensors)
    caplog.set_level(logging.INFO, logger="kvgate.models")
    gguf_loader.convert_to_cache(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.models"]
    assert lines[0].startswith(f"converting tiny.gguf into the cache (first use only): {n} tensors, ")
    assert lines[1].startswith("converted tiny.gguf in ") and len(lines) == 3
    assert (
        lines[2].startswith(f"cached tiny.gguf as {tmp_path / 'cache'}/gguf-")
        and "MiB of float32" in lines[2]
    )
    assert "\r" not in capsys.readouterr().err  # no bar when stderr is not a terminal
    caplog.clear()
    gguf_loader.convert_to_cache(path)
    assert not [r for r in caplog.records if r.name == "kvgate.models"]


def test_first_conversion_on_a_terminal_draws_a_bar_that_ends_its_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    n = len(GGUFReader(str(path)).tensors)
    term = _Terminal()
    monkeypatch.setattr(gguf_loader.sys, "stderr", term)
    gguf_loader.convert_to_cache(path)
    out = term.getvalue()
    assert out.startswith("\rconverting tiny.gguf [")
    last = out.rstrip("\n").rsplit("\r", 1)[1]
    assert "#" * 30 in last and f"] {n}/{n} tensors" in last and out.endswith(" MiB\n")
