"""The proxy's Prometheus metrics, on a registry of its own (one per app, never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    """Counters, histograms and gauges named kvc_proxy_*."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvc_proxy_requests", "Client requests by route and outcome", ["route", "outcome"], registry=r)
        self.retries = Counter("kvc_proxy_retries", "Retries on another backend, by the role that failed", ["role"], registry=r)
        self.evictions = Counter("kvc_proxy_evictions", "Backends taken out of rotation", ["role"], registry=r)
        self.backend_requests = Counter("kvc_proxy_backend_requests", "Requests sent to each backend", ["role", "url"], registry=r)
        self.backend_seconds = Histogram(
            "kvc_proxy_backend_seconds", "Duration of backend requests", ["role", "url"], buckets=_SECONDS_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "kvc_proxy_ttft_seconds",
            "Client request arrival to the first streamed byte from D",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.decode_only = Counter(
            "kvc_proxy_decode_only",
            "Prompts D computed without a prefill server: local (short prompt) or fallback (no prefill server left, "
            "or P's KV lost after P's first token went to the client)",
            ["mode"],
            registry=r,
        )
        self.backend_healthy = Gauge("kvc_proxy_backend_healthy", "1 while the backend is in rotation", ["role", "url"], registry=r)
        self.prefix_decisions = Counter(
            "kvc_proxy_prefix_decisions",
            "Prefix-policy choices: hit (a backend had seen a prefix), miss (none had), balance (load won)",
            ["role", "result"],
            registry=r,
        )
        self.prefix_matched_share = Histogram(
            "kvc_proxy_prefix_matched_share",
            "Share of the prompt the chosen backend had seen (prefix policy)",
            ["role"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.first_token = Counter(
            "kvc_proxy_first_token",
            "Streamed requests eligible for first token from prefill: seeded, answer_not_seedable (P stopped, or its "
            "token is part of a character) or no_prompt_digest (P's connector does not state one): D generated all",
            ["result"],
            registry=r,
        )
        self.backend_draining = Gauge(
            "kvc_proxy_backend_draining", "1 while an operator drains the backend", ["role", "url"], registry=r
        )
        self.fleet_changes = Counter(
            "kvc_proxy_fleet_changes", "Admin changes to the fleet: add, remove, drain, undrain", ["action"], registry=r
        )
        self.hedges = Counter(
            "kvc_proxy_prefill_hedges",
            "Prefills sent to a second prefill server after the hedge delay, by whose answer was used: won (the "
            "second's), lost (the first's)",
            ["result"],
            registry=r,
        )
        for result in ("won", "lost"):
            self.hedges.labels(result)
        for role in ("prefill", "decode"):  # visible at 0 from the start
            self.retries.labels(role)
            self.evictions.labels(role)
        for mode in ("local", "fallback"):
            self.decode_only.labels(mode)
        for result in ("seeded", "answer_not_seedable", "no_prompt_digest"):
            self.first_token.labels(result)
        for action in ("add", "remove", "drain", "undrain"):
            self.fleet_changes.labels(action)

    def render(self) -> bytes:
        return generate_latest(self.registry)
