"""Proxy benchmarks on real vLLM servers: its routing decisions and its own latency."""
