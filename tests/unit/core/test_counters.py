"""One definition of the counters (kv_connectors/counters.py): every table derived from it has each one."""

from __future__ import annotations

import ast
import inspect
import textwrap

import msgspec
import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from kv_connectors import counters, snapshot, wire
from kv_connectors.counters import COUNTERS, Kind
from kv_connectors.vllm import stats
from kv_connectors.vllm.stats import IntervalStats, KvcPromMetrics, KvcStats

# The names the e2e tests, benchmarks and dashboards read (side-channel stats keys; kvc:<name> metrics).
NAMES = (
    "held_requests",
    "held_blocks",
    "completed_sends",
    "expired_leases",
    "recv_transfers",
    "recv_failures",
    "recv_bytes",
    "recv_blocks",
    "recv_descriptors",
    "recv_seconds",
    "pushes",
    "push_failures",
    "layerwise_pushes",
    "staging_pool_bytes",
    "staging_peak_bytes",
    "staging_allocated_bytes",
    "staging_quarantined_bytes",
    "staging_suspect_peers",
    "staged_transfers",
    "direct_transfers",
    "claims_granted",
    "claims_refused",
    "reads_fenced_by_words",
    "stale_reads_refused",
    "lease_renewals",
    "settled_loads",
    "settling_loads",
    "quarantined_loads",
    "quarantined_bytes",
    "idle_steps",
    "requests_without_params",
)
NOT_METRICS = {"recv_seconds"}  # the load-time histogram kvc:transfer_seconds has the durations


def _prom() -> tuple[KvcPromMetrics, prometheus_client.CollectorRegistry]:
    registry = prometheus_client.CollectorRegistry()

    def bind(cls):
        return lambda *args, **kw: cls(*args, registry=registry, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    class _Cfg:
        kv_transfer_config = None

    prom = KvcPromMetrics(_Cfg(), {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    return prom, registry


def test_the_definition_keeps_every_name():
    assert tuple(c.name for c in COUNTERS) == NAMES
    assert {c.name for c in COUNTERS if not c.metric} == NOT_METRICS
    assert all(c.help and c.help.endswith(".") for c in COUNTERS)
    gauges = {c.name for c in COUNTERS if c.kind is Kind.GAUGE}
    assert gauges == {
        "held_requests",
        "held_blocks",
        "staging_pool_bytes",
        "staging_peak_bytes",
        "staging_allocated_bytes",
        "staging_quarantined_bytes",
        "staging_suspect_peers",
        "settling_loads",
        "quarantined_loads",
        "quarantined_bytes",
    }


def test_the_wire_struct_has_every_counter():
    fields = {f.name for f in msgspec.structs.fields(wire.StatsReply)}
    assert fields == {*NAMES, "engine_id", "rank", "tp_size", "ranks"}
    reply = wire.StatsReply(engine_id="e")
    assert all(getattr(reply, n) == 0 for n in NAMES)
    # every counter crosses the side channel
    values = {n: i + 1 for i, n in enumerate(NAMES)}
    back = wire.decode(wire.encode(wire.StatsReply(engine_id="e", **values), "h"), None)
    assert isinstance(back, wire.StatsReply) and all(getattr(back, n) == v for n, v in values.items())


def test_the_metric_tables_have_every_exported_counter():
    exported = [n for n in NAMES if n not in NOT_METRICS]
    assert sorted([*stats.COUNTERS, *stats.GAUGES]) == sorted(exported)
    assert set(stats.COUNTERS).isdisjoint(stats.GAUGES)
    assert stats.COUNTERS == counters.metrics(Kind.COUNTER) and stats.GAUGES == counters.metrics(Kind.GAUGE)
    assert set(KvcStats().data["counters"]) == set(stats.COUNTERS)


def test_interval_stats_and_prometheus_carry_every_exported_counter():
    values = {n: i + 1 for i, n in enumerate(NAMES)}
    interval = IntervalStats()
    s = interval.take(wire.StatsReply(engine_id="e", **values), [0.5])
    assert s is not None
    assert s.data["counters"] == {n: values[n] for n in stats.COUNTERS}
    assert s.data["gauges"] == {n: values[n] for n in stats.GAUGES}
    merged = KvcStats().aggregate(s)
    assert merged.data["counters"] == s.data["counters"] and merged.data["gauges"] == s.data["gauges"]
    prom, registry = _prom()
    prom.observe(merged.data)
    for name in stats.COUNTERS:
        assert registry.get_sample_value(f"kvc:{name}_total", {"engine": "0"}) == values[name], name
    for name in stats.GAUGES:
        assert registry.get_sample_value(f"kvc:{name}", {"engine": "0"}) == values[name], name
    assert registry.get_sample_value("kvc:transfer_seconds_count", {"engine": "0"}) == 1


def test_staging_allocated_bytes_is_in_every_table():
    """Once missing from the gauges: now derived with the rest."""
    name = "staging_allocated_bytes"
    assert name in {c.name for c in COUNTERS}
    assert name in {f.name for f in msgspec.structs.fields(wire.StatsReply)}
    assert name in stats.GAUGES
    prom, registry = _prom()
    prom.observe({"gauges": {name: 4096}})
    assert registry.get_sample_value(f"kvc:{name}", {"engine": "0"}) == 4096


def test_the_engine_produces_every_counter():
    """kv_connectors.snapshot (and its staging part) sets each one but the scheduler side's (its own
    stats, tests/unit/vllm/test_requests_without_params.py): none is left at its default 0."""
    produced: set[str] = set()
    for fn in (snapshot.snapshot, snapshot._staging_stats):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if isinstance(node, ast.keyword) and node.arg:
                produced.add(node.arg)
            elif isinstance(node, ast.Dict):
                produced.update(k.value for k in node.keys if isinstance(k, ast.Constant))
    assert produced >= set(NAMES) - set(stats.SCHEDULER_SIDE), set(NAMES) - produced
    assert produced.isdisjoint(stats.SCHEDULER_SIDE)
