"""The "quietly not disaggregated" trap made visible: a decode-only instance (kv_consumer) counts the
requests that reach it without a prefill instance's kv_transfer_params (a router that is not
disaggregating: D computes every prompt itself, answers stay exact, nothing moves) and warns,
rate-limited, naming the likely cause. vLLM's own Scheduler adds the requests (its add_request calls
on_new_request); the count leaves through the scheduler-side connector's get_kv_connector_stats,
which vLLM's scheduler merges into the worker's stats each step, to kvc:requests_without_params_total."""

from __future__ import annotations

import logging

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from kv_connectors.counters import COUNTERS, Kind
from kv_connectors.vllm import stats
from kv_connectors.vllm.stats import KvcPromMetrics, KvcStats
from tests.unit.vllm.vllm_objects import rejected_stand_in, request, scheduler

NAME = "requests_without_params"
PROMPT = list(range(4, 84))
P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "p-engine",
    "remote_request_id": "p-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5710,
    "remote_num_tokens": len(PROMPT),
}


def _counted(sched) -> int:
    s = sched.connector.get_kv_connector_stats()
    return 0 if s is None else s.data["counters"][NAME]


def test_the_counter_is_declared_once_and_exported():
    (entry,) = [c for c in COUNTERS if c.name == NAME]
    assert entry.kind is Kind.COUNTER and entry.metric and "kv_transfer_params" in entry.help
    assert NAME in stats.COUNTERS and NAME in stats.SCHEDULER_SIDE


def test_a_consumer_counts_requests_without_p_params_and_warns_once(caplog):
    d = scheduler("kv_consumer")
    with caplog.at_level(logging.WARNING, logger="kv_connectors.vllm.scheduler"):
        for i in range(3):
            d.add_request(request(f"plain-{i}", PROMPT, None))  # what smg with plain --decode URLs sends
        d.add_request(request("p-request-sent-to-d", PROMPT, {"do_remote_decode": True}))  # P's request, misrouted
        d.add_request(request("paired", PROMPT, P_PARAMS))  # P's params: not counted
        d.add_request(rejected_stand_in("stand-in", P_PARAMS))  # vLLM's stand-in to free P's blocks: not counted
    assert _counted(d) == 4
    assert _counted(d) == 0, "an interval's count is reported once"
    warnings = [r.getMessage() for r in caplog.records if "kv_transfer_params" in r.getMessage()]
    assert len(warnings) == 1, warnings  # rate-limited: the first one only
    (text,) = warnings
    assert "without a prefill instance's kv_transfer_params" in text and "smg" in text and "--local-prefill-below" in text
    d.add_request(request("plain-later", PROMPT, None))
    assert _counted(d) == 1


def test_producers_and_kv_both_instances_count_nothing(caplog):
    for role in ("kv_producer", "kv_both"):
        sched = scheduler(role)
        with caplog.at_level(logging.WARNING, logger="kv_connectors.vllm.scheduler"):
            sched.add_request(request(f"{role}-plain", PROMPT, None))
        assert sched.connector.get_kv_connector_stats() is None, role
    assert not [r for r in caplog.records if "kv_transfer_params" in r.getMessage()]


def _prom() -> tuple[KvcPromMetrics, prometheus_client.CollectorRegistry]:
    registry = prometheus_client.CollectorRegistry()

    def bind(cls):
        return lambda *args, **kw: cls(*args, registry=registry, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    class _Cfg:
        kv_transfer_config = None

    prom = KvcPromMetrics(_Cfg(), {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    return prom, registry


def test_the_count_reaches_prometheus_merged_with_the_workers_stats():
    """What vLLM's scheduler does each step: worker stats.aggregate(scheduler stats), then observe."""
    d = scheduler("kv_consumer")
    for i in range(2):
        d.add_request(request(f"plain-{i}", PROMPT, None))
    from_scheduler = d.connector.get_kv_connector_stats()
    worker = KvcStats()
    worker.data["counters"]["recv_transfers"] = 5
    merged = worker.aggregate(from_scheduler)
    assert merged.data["counters"][NAME] == 2 and merged.data["counters"]["recv_transfers"] == 5
    assert KvcStats(data=from_scheduler.data).reduce()["requests without params"] == 2  # vLLM's periodic log line
    prom, registry = _prom()
    prom.observe(merged.data)
    assert registry.get_sample_value(f"kvc:{NAME}_total", {"engine": "0"}) == 2
