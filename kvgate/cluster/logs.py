"""Logging in the cluster's Ray worker processes, the ingress and each replica, as `kvgate serve` sets
it up in its own (`logging.basicConfig` at `--log-level`).

A Ray worker starts with kvgate's loggers unconfigured: its INFO lines (`request <id> refused: ...`
for every refusal, a replica's ready line) were dropped, so an operator could not find why a request
was refused (QA: 0 refusal lines on the cluster). `configure(level)` puts the `kvgate` loggers at
`--log-level` and makes sure a handler writes them to the worker's stderr, which Ray forwards to
`kvgate cluster`'s terminal (and keeps in its log directory, `worker-*.err`).
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as `kvgate serve`'s


def level_of(name: str) -> int:
    """The logging level `name` names (case-insensitive), or ValueError saying which ones exist."""
    level = logging.getLevelNamesMapping().get(str(name).upper())
    if level is None:
        raise ValueError(f"log level must be one of critical, error, warning, info, debug, not {name!r}")
    return level


def configure(level: str) -> None:
    """The `kvgate` loggers at `level`, written to stderr: a root handler unless the process has one
    (the root's own level is left alone, so other libraries keep theirs)."""
    logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger("kvgate").setLevel(level_of(level))
