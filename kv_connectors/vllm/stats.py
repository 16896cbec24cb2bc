"""Our counters through vLLM's own mechanisms: KVConnectorStats (logged each interval) and
Prometheus metrics on the server's /metrics (vLLM builds them with build_prom_metrics)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kv_connectors import wire
from kv_connectors.counters import PHASE_HELP, Kind, Phase, metrics
from kv_connectors.vllm.compat import KVConnectorPromMetrics, KVConnectorStats, create_metric_per_engine

# Derived from the one definition (kv_connectors/counters.py), with their metric documentation.
# Cumulative StatsReply fields, reported as per-interval increments:
COUNTERS: dict[str, str] = metrics(Kind.COUNTER)
# Point-in-time values: the latest one wins.
GAUGES: dict[str, str] = metrics(Kind.GAUGE)
# Counted by the scheduler side (SchedulerSide.take_stats, through the scheduler connector's
# get_kv_connector_stats, which vLLM merges into the worker's stats each step): the worker's snapshot
# and the side channel's stats reply leave them 0.
REQUESTS_WITHOUT_PARAMS = "requests_without_params"
SCHEDULER_SIDE = (REQUESTS_WITHOUT_PARAMS,)
DURATIONS = "transfer_seconds"
PHASES = "phases"  # {Phase value: [seconds]}: the per-phase histograms kvc:<phase>_seconds


@dataclasses.dataclass
class KvcStats(KVConnectorStats):
    """One interval of our counters: increments, latest gauges and each load's duration.

    data = {"counters": {name: int}, "gauges": {name: int}, "transfer_seconds": [float],
    "phases": {phase: [float]}}: plain containers, as vLLM sends it between processes."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": dict.fromkeys(COUNTERS, 0), "gauges": {}, DURATIONS: [], PHASES: {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = self.data["counters"]
        for name, value in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + value
        self.data["gauges"].update(other.data.get("gauges", {}))
        self.data[DURATIONS].extend(other.data.get(DURATIONS, []))
        phases = self.data.setdefault(PHASES, {})
        for name, values in other.data.get(PHASES, {}).items():
            phases.setdefault(name, []).extend(values)
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
        if c.get(REQUESTS_WITHOUT_PARAMS):
            out["requests without params"] = c[REQUESTS_WITHOUT_PARAMS]
        if "held_blocks" in self.data["gauges"]:
            out["held blocks"] = self.data["gauges"]["held_blocks"]
        return out

    def is_empty(self) -> bool:
        return (
            not any(self.data["counters"].values())
            and not self.data["gauges"]
            and not self.data[DURATIONS]
            and not any(self.data.get(PHASES, {}).values())
        )


class IntervalStats:
    """Worker side: turns cumulative StatsReply snapshots into per-interval KvcStats."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._last_snapshot: wire.StatsReply | None = None

    def take(
        self, snapshot: wire.StatsReply, durations: list[float], phases: dict[Phase, list[float]] | None = None
    ) -> KvcStats | None:
        if snapshot is self._last_snapshot and not durations and not any((phases or {}).values()):
            return None  # the engine took no new snapshot (a quiet step): nothing changed
        self._last_snapshot = snapshot
        now = {name: getattr(snapshot, name) for name in (*COUNTERS, *GAUGES)}
        stats = KvcStats()
        stats.data["counters"] = {name: now[name] - self._last.get(name, 0) for name in COUNTERS}
        stats.data["gauges"] = {name: now[name] for name in GAUGES if now[name] != self._last.get(name, 0)}
        stats.data[DURATIONS] = list(durations)
        stats.data[PHASES] = {phase.value: list(values) for phase, values in (phases or {}).items() if values}
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

        self._phases = {
            phase.value: self._per_engine(
                self._histogram_cls(
                    name=f"kvc:{phase.value}_seconds", documentation=PHASE_HELP[phase], buckets=buckets, labelnames=labelnames
                )
            )
            for phase in Phase
        }

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
        for name, values in transfer_stats_data.get(PHASES, {}).items():
            if name in self._phases:
                for seconds in values:
                    self._phases[name][engine_idx].observe(seconds)
