"""Our counters as vLLM metrics: per-interval KvcStats and the Prometheus metrics built from them."""

from __future__ import annotations

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from kv_connectors import wire
from kv_connectors.vllm.stats import IntervalStats, KvcPromMetrics, KvcStats


def _reply(**kw) -> wire.StatsReply:
    return wire.StatsReply(engine_id="e", **kw)


def test_interval_stats_report_increments_and_changed_gauges():
    interval = IntervalStats()
    assert interval.take(_reply(), []) is None  # nothing happened
    s = interval.take(_reply(recv_transfers=2, recv_bytes=4096, held_blocks=3, held_requests=1), [0.001, 0.003])
    assert s is not None and s.data["counters"]["recv_transfers"] == 2 and s.data["counters"]["recv_bytes"] == 4096
    assert s.data["gauges"] == {"held_blocks": 3, "held_requests": 1}
    s = interval.take(_reply(recv_transfers=3, recv_bytes=6144, held_blocks=3, held_requests=1), [0.002])
    assert s is not None and s.data["counters"]["recv_transfers"] == 1 and s.data["gauges"] == {}
    s = interval.take(_reply(recv_transfers=3, recv_bytes=6144), [])
    assert s is not None and s.data["gauges"] == {"held_blocks": 0, "held_requests": 0}  # back to 0 is news


def test_stats_aggregate_and_reduce():
    a = KvcStats()
    a.data["counters"]["recv_transfers"] = 1
    a.data["counters"]["recv_bytes"] = 2_000_000
    a.data["transfer_seconds"] = [0.001]
    b = KvcStats(
        data={"counters": {"recv_transfers": 1, "recv_bytes": 2_000_000}, "gauges": {"held_blocks": 5}, "transfer_seconds": [0.003]}
    )
    merged = a.aggregate(b)
    r = merged.reduce()
    assert r["loads"] == 2 and r["MB loaded"] == 4.0 and r["load GB/s"] == 1.0 and r["avg load ms"] == 2.0
    assert r["held blocks"] == 5
    assert KvcStats().is_empty() and not merged.is_empty()


def test_prometheus_metrics_follow_observations():
    registry = prometheus_client.CollectorRegistry()

    def bind(cls):
        return lambda *args, **kw: cls(*args, registry=registry, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    class _Cfg:
        kv_transfer_config = None

    prom = KvcPromMetrics(_Cfg(), {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    prom.observe({"counters": {"recv_transfers": 2, "pushes": 1}, "gauges": {"held_blocks": 7}, "transfer_seconds": [0.002, 0.004]})
    prom.observe({"counters": {"recv_transfers": 1}, "gauges": {"held_blocks": 0}, "transfer_seconds": []})

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0"})

    assert value("kvc:recv_transfers_total") == 3
    assert value("kvc:pushes_total") == 1
    assert value("kvc:held_blocks") == 0
    assert value("kvc:transfer_seconds_count") == 2
    prom.observe({"counters": {}, "gauges": {}, "transfer_seconds": [], "phases": {"load_queue": [0.5, 1.5], "lease_hold": [2.0]}})
    assert (value("kvc:load_queue_seconds_count"), value("kvc:load_queue_seconds_sum")) == (2, 2.0)
    assert value("kvc:lease_hold_seconds_sum") == 2.0 and value("kvc:load_claim_seconds_count") == 0
