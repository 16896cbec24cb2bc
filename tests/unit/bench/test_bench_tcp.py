"""bench_transport's raw TCP baseline: the same bytes over a socket between two processes."""

from __future__ import annotations

from benchmarks.transport.bench_transport import tcp_gbps


def test_tcp_baseline_times_each_repeat():
    out = tcp_gbps(1 << 20, 3)
    assert len(out) == 3 and all(g > 0 for g in out)
