"""`--memory-limit`: a size, a fraction of the device's memory, or auto, resolved to bytes.

A limit above what the device has is refused (a plan for memory that is not there promises what it
cannot keep); every error names the forms the flag takes.
"""

from __future__ import annotations

import re

from kvgate.units import SizeError, fmt_bytes, parse_bytes

# "auto" on CPU: a quarter of MemAvailable at startup (the KV pool is zero-filled, so that is real)
AUTO_CPU_SHARE = 0.25
AUTO_CUDA_SHARE = 0.9  # "auto" on CUDA: 90% of the free device memory at startup


class PlanError(ValueError):
    pass


def device_memory(device: str) -> tuple[int, int]:
    """(total, available) bytes of the device's memory."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total, free
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])


LIMIT_HELP = "write a size (4GiB, 512MiB, 2000000000 bytes), a fraction of device memory (0.5), or auto"


def resolve_limit(spec: str, device: str) -> tuple[int, str]:
    """`--memory-limit` -> (bytes, how it was derived)."""
    text = str(spec).strip()
    if text.lower() == "auto":
        total, available = device_memory(device)
        share = AUTO_CUDA_SHARE if device.startswith("cuda") else AUTO_CPU_SHARE
        what = "free device memory" if device.startswith("cuda") else "available RAM"
        return int(available * share), f"auto: {share:.0%} of {what} ({fmt_bytes(available)})"
    if re.fullmatch(r"[0-9]*\.[0-9]+|[0-9]+\.|1", text):  # a bare number with a point: a fraction
        share = float(text)
        if not 0 < share <= 1:
            hint = f" (for a size give a unit: {text}GiB)" if share > 1 else ""
            raise PlanError(
                f"--memory-limit {spec}: a fraction of device memory must be in (0, 1]{hint}; {LIMIT_HELP}."
            )
        total, _ = device_memory(device)
        return int(total * share), f"{share:.0%} of {fmt_bytes(total)} device memory"
    if text.startswith("-"):
        raise PlanError(f"--memory-limit {spec} must be more than zero: {LIMIT_HELP}.")
    try:
        limit = parse_bytes(text)
    except SizeError:
        raise PlanError(f"--memory-limit {spec!r} is not understood: {LIMIT_HELP}.") from None
    if limit <= 0:
        raise PlanError(f"--memory-limit {spec!r} must be more than zero: {LIMIT_HELP}.")
    total, _ = device_memory(device)
    if limit > total:  # a plan for memory the machine does not have promises what it cannot keep
        what = "this GPU's memory" if device.startswith("cuda") else "this machine's RAM"
        raise PlanError(
            f"--memory-limit {spec} is more than {what} ({fmt_bytes(total)}): the plan would admit requests "
            f"for memory that is not there. Give at most {fmt_bytes(total)}, a fraction (0.5), or auto."
        )
    return limit, "explicit"
