"""Argument types that refuse a value outside its range at the command line, naming the flag.

argparse prints `argument --max-seqs: must be at least 1 (got 0)` and exits 2 before anything loads.
Before these, `--max-queue -1` killed the engine worker at startup while the process stayed up,
`--prefill-chunk 0` killed it at the first request, and `--port 99999` listened on 34463 (session 31's
QA). The string settings with a fixed set of values take argparse's `choices` in `kvgate.config`.
"""

from __future__ import annotations

import argparse


def at_least(kind: type, low, high=None):
    """A converter to `kind` refusing values under `low` (or over `high`)."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if value < low or (high is not None and value > high):
            span = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {span} (got {text})")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in some messages
    return convert


def more_than(kind: type, low):
    """A converter to `kind` refusing values at or under `low`."""

    def convert(text: str):
        value = at_least(kind, float("-inf"))(text)
        if value <= low:
            raise argparse.ArgumentTypeError(f"must be more than {low} (got {text})")
        return value

    convert.__name__ = kind.__name__
    return convert


PORT = at_least(int, 1, 65535)


def one_of(*values: str):
    """A converter refusing a word outside `values`; unlike argparse's `choices`, it also checks a default
    read from the environment (argparse converts a string default with `type`)."""

    def convert(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(values)}")
        return text

    convert.__name__ = "word"
    return convert


def auto_or(kind):
    """`kind`, or None for the word auto."""

    def convert(text):
        return None if text == "auto" else kind(text)

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


def byte_size(text: str) -> int:
    """A size such as 64MiB, 2GB or 1000000 (0 allowed), as bytes."""
    from kvgate.units import SizeError, parse_bytes

    try:
        return parse_bytes(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
