"""Everything one proxy app holds: config, backend pools, metrics and the shared HTTP client."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from .backends import BackendPool
from .config import Flow, ProxyConfig, Role
from .hedge import HedgePolicy
from .metrics import ProxyMetrics


@dataclass
class ProxyContext:
    config: ProxyConfig
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    client: httpx.AsyncClient | None = None
    prefill: BackendPool = field(init=False)
    decode: BackendPool = field(init=False)
    hedge: HedgePolicy = field(init=False)  # the prefill pool's

    def __post_init__(self) -> None:
        cfg = self.config
        self.prefill = BackendPool(Role.PREFILL, cfg.prefill, cfg.prefill_policy, self.metrics, cfg.prefix)
        self.decode = BackendPool(Role.DECODE, cfg.decode, cfg.decode_policy, self.metrics, cfg.prefix)
        self.hedge = HedgePolicy(cfg.hedge)

    @property
    def flow(self) -> Flow:
        return self.config.resolved_flow

    def learns_from_events(self) -> bool:
        """Some backend's prefix cache is fed by its KV events (--kv-events)."""
        return any(b.events is not None for pool in (self.prefill, self.decode) for b in pool.backends)

    def pool(self, role: Role) -> BackendPool:
        return self.prefill if role is Role.PREFILL else self.decode

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("proxy HTTP client not started (the app's lifespan has not run)")
        return self.client
