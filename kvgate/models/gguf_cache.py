"""Housekeeping of the GGUF cache (`kvgate.models.gguf_loader`): one entry per source file.

A converted GGUF is a float32 copy, about five times the size of a Q4 file, and a file that changes
(touched, re-downloaded, rewritten) gets a new cache key. Without cleanup every version stayed on disk
and nothing said where or how big (QA pass 7: ten versions of one file, 4.6 GB). So each entry records
the file it came from and that version's modification time (`source.json`), a conversion removes the
entries of older versions of the same path (never a newer one: a slow conversion of an old version that
finishes last leaves the current one alone), and the log names the entry and its size. A process still
loading from a removed entry fails its load (a file changed under a running start; start it again).
Entries of earlier cache formats have no `source.json` and are left for the operator.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger("kvgate.models")
SOURCE = "source.json"


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def settle(entry: Path, source: Path) -> list[Path]:
    """Record `source` in the fresh `entry`, remove the entries earlier versions of `source` left in
    the same cache folder, and log both; returns the removed entries."""
    origin, mtime = str(source.resolve()), source.stat().st_mtime_ns
    (entry / SOURCE).write_text(json.dumps({"path": origin, "mtime_ns": mtime}))
    removed = []
    for other in entry.parent.glob("gguf-*"):
        if other == entry or not (other / SOURCE).is_file():
            continue
        try:
            seen = json.loads((other / SOURCE).read_text())
        except (OSError, ValueError):
            continue
        if seen.get("path") != origin or seen.get("mtime_ns", 0) > mtime:
            continue
        size = dir_bytes(other)
        shutil.rmtree(other, ignore_errors=True)
        removed.append(other)
        log.info("removed %s (%.0f MiB), the cache of an earlier version of %s", other, size / 2**20, origin)
    log.info(
        "cached %s as %s (%.0f MiB of float32; later loads read it; KVGATE_CACHE_DIR moves the cache)",
        source.name,
        entry,
        dir_bytes(entry) / 2**20,
    )
    return removed
