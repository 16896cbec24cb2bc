"""Benchmarks, run from the repository root as modules: `python -m benchmarks.bench_e2e --help`."""
