"""Benchmarks, one family a sub-package, each run from the repository root as a module
(`python -m benchmarks.e2e.bench_e2e --help`):

- transport/: two processes, one transport, every byte verified (bench_transport: against memcpy, with
  --sweep and --baseline; bench_staging: staged against direct); harness.py is what both drive.
- e2e/: real vLLM servers, TTFT against vLLM's built-in connector and colocated (bench_e2e,
  bench_layerwise); configs.py (the set-ups and their servers), client.py (the load and its verdict),
  stats.py (the figures).
- faults/: real servers driven into faults (bench_faults: one fault at a time, ours against the
  built-in; bench_load: 2P2D behind the proxy under load while faults happen).
- router/: the proxy's routing decisions (bench_router) and its own latency (bench_proxy).
- scheduler/: the scheduler-side hooks' cost per step, no engine (bench_hooks).
- gpu/: the GPU end-to-end check on one CUDA host (gpu_check, gpu_check.sh), which reuses e2e's load
  and runs bench_staging.

Modules here are what several families use: host.py (the host line of a report), plots.py. A script
(`bench_*`) is imported by no other module: what two scripts share lives in a helper module of their
family, or here. Figures recorded from runs are in results/ and docs/benchmarks.md.
"""
