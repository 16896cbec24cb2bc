"""Transport benchmarks: P in its own process and D here over one transport, every byte verified."""
