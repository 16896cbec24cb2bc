"""Fault benchmarks on real vLLM servers: how each fault ends, and a load run while faults happen."""
