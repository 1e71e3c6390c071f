"""Benchmark scripts: `python -m bench.compare`, `bench.bandwidth`, `bench.run_all`, `bench.soak`."""
