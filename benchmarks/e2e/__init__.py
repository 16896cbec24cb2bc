"""End-to-end benchmarks on real vLLM servers: TTFT of each 1P1D set-up against the built-in and colocated."""
