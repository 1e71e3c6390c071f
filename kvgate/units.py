"""Byte sizes as people write them (`4GiB`, `512MiB`, `2000000000`) and as kvgate prints them."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 10**12, "tb": 10**12})


class SizeError(ValueError):
    pass


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise SizeError(f"cannot read {text!r} as a size: use bytes like 4GiB, 512MiB or 2000000000")
    if "." in m.group(1) and _UNITS[m.group(2).lower()] == 1:  # 0.5 bytes: read as 0 before (QA pass 15)
        raise SizeError(f"{text!r} is not a whole number of bytes: give a unit (0.5GiB) or whole bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
