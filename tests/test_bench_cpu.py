"""The CPU line under every benchmark table names the Zen generation a VM's bare "AMD EPYC" hides.

Zen 4 and Zen 5 both list avx512f and avx512_bf16 (one class, "AVX-512+bf16 AMD"), but Zen 4 runs a
512-bit op on 256-bit units: session 16's Zen 4 ran the float gguf layers at one row 1.6x slower than
session 11's Zen 5. Seen red: with Zen 4's model ranges left out, the first test fails.
"""

from bench.cpu import amd_core, cpu_line


def test_the_zen_generation_follows_family_and_model():
    assert amd_core(25, 17) == "Zen 4"  # EPYC Genoa, session 16
    assert amd_core(25, 0x61) == "Zen 4"
    assert amd_core(25, 1) == "Zen 3"  # EPYC Milan
    assert amd_core(26, 2) == "Zen 5"
    assert amd_core(6, 143) is None


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
    # bench/compare.py reads the class as the first parenthesis of this line
    assert line.split("(", 1)[1].split(")", 1)[0] == "AVX-512+bf16 AMD"
    assert "family 25 model 17 = Zen 4 at 2.6 GHz, 2 vCPUs" in line
    old = {k: v for k, v in m.items() if k not in ("cpu_family", "cpu_model", "core", "mhz")}
    assert cpu_line(old) == "CPU: AMD EPYC (AVX-512+bf16 AMD), 2 vCPUs; flags avx2 avx512f (no amx_tile)."
