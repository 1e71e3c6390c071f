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
