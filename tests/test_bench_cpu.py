"""The CPU line under every benchmark table names the Zen generation a VM's bare "AMD EPYC" hides.

Zen 4 and Zen 5 both list avx512f and avx512_bf16 (one class, "AVX-512+bf16 AMD"), but Zen 4 runs a
512-bit op on 256-bit units: session 16's Zen 4 ran the float gguf layers at one row 1.6x slower than
session 11's Zen 5. Seen red: with Zen 4's model ranges left out, the first test fails.
"""

from bench.cpu import amd_core, class_of, cpu_line, intel_core


def test_the_zen_generation_follows_family_and_model():
    assert amd_core(25, 17) == "Zen 4"  # EPYC Genoa, session 16
    assert amd_core(25, 0x61) == "Zen 4"
    assert amd_core(25, 1) == "Zen 3"  # EPYC Milan
    assert amd_core(26, 2) == "Zen 5"
    assert amd_core(6, 143) is None


def test_an_intel_guest_names_its_core():
    """Session 40's "Intel(R) Xeon(R) Processor" was family 6 model 207, an Emerald Rapids shown without
    avx512_bf16 or AMX. Red with the table emptied (None)."""
    assert intel_core(6, 207) == "Emerald Rapids"
    assert intel_core(6, 143) == "Sapphire Rapids"
    assert intel_core(25, 17) is None and intel_core(6, 1) is None


def test_the_cpu_line_keeps_the_class_first_and_adds_family_model_and_clock():
    m = {
        "model_name": "AMD EPYC",
        "cpu_class": "AVX-512+bf16 AMD",
        "cpu_family": 25,
        "cpu_model": 17,
        "core": "Zen 4",
        "mhz": 2596.0,
        "cpus": 2,
        "flags_present": ["avx2", "avx512f"],
        "flags_absent": ["amx_tile"],
    }
    line = cpu_line(m)
    assert line.split("(", 1)[1].split(")", 1)[0] == "AVX-512+bf16 AMD"
    assert "family 25 model 17 = Zen 4 at 2.6 GHz, 2 vCPUs" in line
    old = {k: v for k, v in m.items() if k not in ("cpu_family", "cpu_model", "core", "mhz")}
    assert cpu_line(old) == "CPU: AMD EPYC (AVX-512+bf16 AMD), 2 vCPUs; flags avx2 avx512f (no amx_tile)."


def test_the_class_of_an_intel_guest_is_not_read_off_its_name():
    """BENCHMARKS' machine line took the class as the first parenthesis of the CPU line, and Intel's
    model name has its own: "class: R." (session 40); compare now asks `class_of`. Red with `class_of`
    returning that parse of `cpu_line(m)`."""
    m = {"model_name": "Intel(R) Xeon(R) Processor", "cpus": 2, "flags_present": ["avx512f"]}
    m["flags_absent"] = ["avx512_bf16", "amx_tile"]
    assert class_of(m) == "AVX-512 Intel"
    assert "Intel(R) Xeon(R) Processor (AVX-512 Intel)" in cpu_line(m)
