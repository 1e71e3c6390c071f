"""A killed build of the C++ kernels must not hang every later start (kvgate.models.native._build_lock).

torch's cpp_extension waits forever while its `lock` file exists; a build killed mid-way (the first
`make serve` stopped with Ctrl-C, a test server killed during its start) left one, and the next
`make setup` hung on it at 0% CPU (seen in session 16). Seen red: with the stale file's removal taken
out, the first test fails; with the flock taken out, the second does.
"""

from __future__ import annotations

import threading
import time

from kvgate.models import native


def test_a_dead_builds_lock_file_is_removed_before_the_build(tmp_path):
    (tmp_path / "lock").write_text("")
    with native._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists(), "torch's baton would wait on this file forever"


def test_a_second_build_waits_for_the_first_to_finish(tmp_path):
    order = []
    first_in = threading.Event()

    def first():
        with native._build_lock(tmp_path):
            first_in.set()
            time.sleep(0.3)
            order.append("first done")

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(10)
    with native._build_lock(tmp_path):
        order.append("second in")
    t.join()
    assert order == ["first done", "second in"]


def test_a_refused_build_is_remembered_until_the_tools_change(tmp_path, monkeypatch):
    """A build the compiler refused ran again at every start (minutes each, session 35's open end); it
    is now remembered per sources and tools. A build killed for memory is not, and other tools retry.
    Seen red with `_failed_before` returning None (the second start built again)."""
    import torch.utils.cpp_extension as cpp

    calls = []

    def refused(**_kw):
        calls.append(1)
        raise RuntimeError("tile_matmul.cpp:1:1: error: boom\nninja: build stopped")

    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "kvgate_native_x")
    monkeypatch.setattr(native, "_compiler_id", lambda: "g++@1 ninja@1")
    monkeypatch.setattr(cpp, "load", refused)
    monkeypatch.setattr(native, "_state", {})
    assert native.extension() is None and len(calls) == 1
    monkeypatch.setattr(native, "_state", {})  # the next start
    assert native.extension() is None and len(calls) == 1, "the refused build ran again"
    assert "failed here at" in native.unavailable() and "error: boom" in native.unavailable()
    assert str(tmp_path / "kvgate_native_x" / native.FAILED) in native.unavailable()
    monkeypatch.setattr(native, "_compiler_id", lambda: "g++@2 ninja@1")  # another compiler: tried again
    monkeypatch.setattr(native, "_state", {})
    assert native.extension() is None and len(calls) == 2

    def killed(**_kw):  # or stopped with Ctrl-C, or a header not installed yet
        calls.append(1)
        raise RuntimeError(
            [
                "g++: fatal error: Killed signal terminated program cc1plus",
                "ninja: build stopped: interrupted by user.",
            ][len(calls) % 2]
        )

    (tmp_path / "kvgate_native_x" / native.FAILED).unlink()
    monkeypatch.setattr(cpp, "load", killed)
    for _start in range(2):  # a build killed for memory is tried again
        monkeypatch.setattr(native, "_state", {})
        native.extension()
    assert len(calls) == 4
