"""Facts about the CPU the benchmarks ran on: model, instruction-set flags, and the class of CPU they put
it in (every table in docs/BENCHMARKS.md carries them, since the peers' ranking depends on them).

The classes seen so far: AVX2-only AMD, AVX-512+bf16 AMD, AMX Intel, and (session 40) AVX-512 Intel: an
Emerald Rapids whose hypervisor hid its avx512_bf16 and AMX, so a guest must go by the flags it is shown."""

from __future__ import annotations

import os
import platform
import subprocess

NOTABLE_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
VENDORS = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}


def _cpuinfo(*keys: str) -> str | None:
    """The value of the first processor's first line in /proc/cpuinfo named one of `keys`."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (x86: the `flags` line)."""
    return set((_cpuinfo("flags", "Features") or "").split())


def cpu_class(flags: set[str] | list[str], vendor_id: str | None) -> str:
    """'AVX2-only AMD', 'AVX-512+bf16 AMD', 'AMX Intel', ... from the flags and lscpu's vendor id."""
    flags = set(flags)
    vendor = VENDORS.get(vendor_id or "", vendor_id or "unknown vendor")
    if flags & {"amx_tile", "amx_int8", "amx_bf16"}:
        isa = "AMX"
    elif "avx512f" in flags and "avx512_bf16" in flags:
        isa = "AVX-512+bf16"
    elif "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2-only"
    else:
        isa = "pre-AVX2"
    return f"{isa} {vendor}"


def amd_core(family: int | None, model: int | None) -> str | None:
    """The Zen generation of an AMD family/model pair (lscpu's decimal numbers), where it is known.

    A VM often names the CPU only "AMD EPYC"; Zen 4 (family 25, models 0x10-0x1f, 0x60-0x7f, 0xa0-0xaf)
    runs AVX-512 on 256-bit units and Zen 5 (family 26) on 512-bit ones, which moves every float-kernel
    number, so the tables say which one ran."""
    if family == 26:
        return "Zen 5"
    if family == 25 and model is not None:
        return "Zen 4" if model >> 4 in (0x1, 0x6, 0x7, 0xA) else "Zen 3"
    if family == 23:
        return "Zen 1/2"
    return None


INTEL_CORES = {  # family 6 server models (lscpu's decimal numbers) that these machines have shown or may show
    85: "Skylake-SP/Cascade Lake",
    106: "Ice Lake-SP",
    108: "Ice Lake-SP",
    143: "Sapphire Rapids",
    207: "Emerald Rapids",
    173: "Granite Rapids",
}


def intel_core(family: int | None, model: int | None) -> str | None:
    """The microarchitecture of an Intel family/model pair, where it is known. A VM names the CPU only
    "Intel(R) Xeon(R) Processor" and may hide flags the core has (session 40's Emerald Rapids showed no
    avx512_bf16 or AMX): the table's line then says which core ran, and the flags what it could use."""
    return INTEL_CORES.get(model) if family == 6 else None


def _cpu_mhz() -> float | None:
    try:
        return float(_cpuinfo("cpu MHz") or "")
    except ValueError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def machine_info() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split()) or cpu_flags()
    vendor_id = fields.get("Vendor ID", "").strip() or None
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    family, model = _int(fields.get("CPU family")), _int(fields.get("Model"))
    return {
        "model_name": fields.get("Model name", "?").strip(),
        "cpu_family": family,
        "cpu_model": model,
        "core": amd_core(family, model) if vendor_id == "AuthenticAMD" else intel_core(family, model),
        "mhz": _cpu_mhz(),
        "vendor_id": vendor_id,
        "cpu_class": cpu_class(flags, vendor_id),
        "cpus": os.cpu_count(),
        "flags_present": [f for f in NOTABLE_FLAGS if f in flags],
        "flags_absent": [f for f in NOTABLE_FLAGS if f not in flags],
        "hypervisor": fields.get("Hypervisor vendor", "").strip() or None,
        "mem_total_bytes": mem,
        "loadavg_at_start": os.getloadavg(),
        "kernel": platform.release(),
    }


def cpu_where(m: dict) -> str:
    """'family 25 model 17 = Zen 4 at 2.6 GHz' from machine_info's fields ('' where they are absent)."""
    if m.get("cpu_family") is None:
        return ""
    core = m.get("core") or intel_core(m["cpu_family"], m.get("cpu_model"))  # results before session 40
    return (
        f"family {m['cpu_family']} model {m.get('cpu_model')}"
        + (f" = {core}" if core else "")
        + (f" at {m['mhz'] / 1000:.1f} GHz" if m.get("mhz") else "")
    )


def class_of(m: dict) -> str:
    """machine_info's class, or one made from its flags and the vendor its model name says."""
    vendor_id = m.get("vendor_id") or next(
        (k for k, v in VENDORS.items() if v in m.get("model_name", "")), None
    )
    return m.get("cpu_class") or cpu_class(m.get("flags_present", []), vendor_id)


def cpu_line(m: dict) -> str:
    """One line for under a table: model, class, vCPUs, flags of note present and absent."""
    cls = class_of(m)
    absent = m.get("flags_absent") or []
    where = f", {cpu_where(m)}" if cpu_where(m) else ""
    return (
        f"CPU: {m.get('model_name', '?')} ({cls}){where}, {m.get('cpus')} vCPUs; flags "
        f"{' '.join(m.get('flags_present') or []) or 'none of note'}"
        + (f" (no {' '.join(absent)})" if absent else "")
        + "."
    )
