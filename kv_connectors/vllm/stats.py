"""Our counters through vLLM's own mechanisms: KVConnectorStats (logged each interval) and
Prometheus metrics on the server's /metrics (vLLM builds them with build_prom_metrics)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kv_connectors import wire
from kv_connectors.vllm.compat import KVConnectorPromMetrics, KVConnectorStats, create_metric_per_engine

# Cumulative StatsReply fields reported as per-interval increments, with their metric documentation.
COUNTERS: dict[str, str] = {
    "recv_transfers": "KV loads completed on this (decode) instance.",
    "recv_failures": "KV loads that failed on this (decode) instance.",
    "recv_bytes": "Bytes of KV loaded into this instance.",
    "recv_blocks": "KV blocks loaded into this instance.",
    "recv_descriptors": "Transfer descriptors (coalesced byte runs) of the KV loads.",
    "pushes": "Pushes written from this (prefill) instance into a decode instance's blocks.",
    "push_failures": "Pushes from this instance that failed.",
    "layerwise_pushes": "Pushes written layer by layer during the prefill's forward pass.",
    "completed_sends": "Requests whose blocks a decode instance was done with (freed on notice).",
    "expired_leases": "Requests whose blocks were freed because no decode instance came for them.",
    "claims_granted": "Reads of this (prefill) instance's blocks confirmed under a live lease.",
    "claims_refused": "Reads of this (prefill) instance's blocks refused: lease ended, or blocks not held.",
    "stale_reads_refused": "KV loads this (decode) instance failed because the prefill side refused the claim.",
    "lease_renewals": "Prefill leases this (decode) instance kept alive for requests waiting in its queue.",
}
# Point-in-time values: the latest one wins.
GAUGES: dict[str, str] = {
    "held_requests": "Requests whose KV blocks this (prefill) instance holds for a decode instance.",
    "held_blocks": "KV blocks this (prefill) instance holds for decode instances.",
    "staging_pool_bytes": "Configured size of the CPU staging pool (0: no staging).",
    "staging_peak_bytes": "Most staging-pool bytes in use at once.",
    "staging_allocated_bytes": "Staging-pool bytes actually allocated.",
}
DURATIONS = "transfer_seconds"


@dataclasses.dataclass
class KvcStats(KVConnectorStats):
    """One interval of our counters: increments, latest gauges and each load's duration.

    data = {"counters": {name: int}, "gauges": {name: int}, "transfer_seconds": [float]}:
    plain containers, as vLLM sends it between processes."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": dict.fromkeys(COUNTERS, 0), "gauges": {}, DURATIONS: []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = self.data["counters"]
        for name, value in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + value
        self.data["gauges"].update(other.data.get("gauges", {}))
        self.data[DURATIONS].extend(other.data.get(DURATIONS, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        c = self.data["counters"]
        seconds = sum(self.data[DURATIONS])
        out: dict[str, int | float] = {
            "loads": c["recv_transfers"],
            "load failures": c["recv_failures"],
            "MB loaded": round(c["recv_bytes"] / 1e6, 3),
            "load GB/s": round(c["recv_bytes"] / seconds / 1e9, 3) if seconds else 0.0,
            "avg load ms": round(seconds / len(self.data[DURATIONS]) * 1e3, 3) if self.data[DURATIONS] else 0.0,
            "pushes": c["pushes"],
            "push failures": c["push_failures"],
            "expired leases": c["expired_leases"],
        }
        if "held_blocks" in self.data["gauges"]:
            out["held blocks"] = self.data["gauges"]["held_blocks"]
        return out

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"] and not self.data[DURATIONS]


class IntervalStats:
    """Worker side: turns cumulative StatsReply snapshots into per-interval KvcStats."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, snapshot: wire.StatsReply, durations: list[float]) -> KvcStats | None:
        now = {name: getattr(snapshot, name) for name in (*COUNTERS, *GAUGES)}
        stats = KvcStats()
        stats.data["counters"] = {name: now[name] - self._last.get(name, 0) for name in COUNTERS}
        stats.data["gauges"] = {name: now[name] for name in GAUGES if now[name] != self._last.get(name, 0)}
        stats.data[DURATIONS] = list(durations)
        self._last = now
        return None if stats.is_empty() else stats


class KvcPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters, gauges and a load-time histogram, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._per_engine(self._counter_cls(name=f"kvc:{name}", documentation=doc, labelnames=labelnames))
            for name, doc in COUNTERS.items()
        }
        self._gauges = {
            name: self._per_engine(
                self._gauge_cls(name=f"kvc:{name}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
            )
            for name, doc in GAUGES.items()
        }
        buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        self._durations = self._per_engine(
            self._histogram_cls(
                name=f"kvc:{DURATIONS}",
                documentation="Duration of each KV load, from post (or push request) to done.",
                buckets=buckets,
                labelnames=labelnames,
            )
        )

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if value and name in self._counters:
                self._counters[name][engine_idx].inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self._gauges:
                self._gauges[name][engine_idx].set(value)
        for seconds in transfer_stats_data.get(DURATIONS, []):
            self._durations[engine_idx].observe(seconds)
