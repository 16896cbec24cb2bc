"""Backend state (health, outstanding requests), the selection policies, and the active health checker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from .config import BackendSpec, Policy, PrefixSettings, Role, SideChannel
from .kvevents import EventPrefixCache, EventSubscriber
from .metrics import ProxyMetrics
from .prefix import PrefixCache, PromptKey

logger = logging.getLogger("kv_connectors.proxy")


@dataclass(eq=False)
class Backend:
    """One vLLM server's state as the proxy sees it."""

    role: Role
    url: str
    side_channel: SideChannel | None = None
    healthy: bool = True
    draining: bool = False  # taken out of rotation by an operator: no new requests, in-flight ones finish
    outstanding: int = 0
    served: int = 0
    failures: int = 0  # failed requests and failed health checks, all time
    consecutive_check_failures: int = 0
    prefix: PrefixCache | EventPrefixCache | None = None  # with the prefix policy
    events: EventSubscriber | None = None  # its KV event publisher's subscriber (feeds `prefix`)
    removed: bool = False  # taken out of the pool: its series are gone, requests in flight finish
    evicted: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set while out of rotation for health
    dp_turn: int = 0  # the transfer-id flow's next data-parallel engine (round robin)

    def next_dp_rank(self) -> int:
        """The data-parallel engine of this prefill server the next transfer-id prefill goes to."""
        dp_size = self.side_channel.dp_size if self.side_channel is not None else 1
        rank, self.dp_turn = self.dp_turn % dp_size, self.dp_turn + 1
        return rank

    def snapshot(self) -> dict[str, Any]:
        return (
            {
                "url": self.url,
                "healthy": self.healthy,
                "draining": self.draining,
                "outstanding": self.outstanding,
                "served": self.served,
                "failures": self.failures,
                "side_channel": None if self.side_channel is None else str(self.side_channel),
            }
            | ({} if self.prefix is None else {"prefix_chunks": len(self.prefix)})
            | self._events_snapshot()
        )

    def _events_snapshot(self) -> dict[str, Any]:
        if not isinstance(self.prefix, EventPrefixCache) or self.events is None:
            return {}
        return {"kv_events": {"endpoint": self.events.endpoint, **dataclasses.asdict(self.prefix.counts)}}

    @property
    def available(self) -> bool:
        """Whether new requests may go to it."""
        return self.healthy and not self.draining


class BackendCall:
    """One request in flight on a backend: counted as outstanding until end() (idempotent)."""

    def __init__(self, pool: BackendPool, backend: Backend) -> None:
        self.pool, self.backend = pool, backend
        self.start = time.perf_counter()
        self.ended = False
        backend.outstanding += 1
        pool.metrics.backend_requests.labels(pool.role.value, backend.url).inc()

    def end(self, ok: bool | None) -> None:
        """The call is over: served (ok), failed, or None: cancelled by the proxy (counted as neither)."""
        if self.ended:
            return
        self.ended = True
        self.backend.outstanding -= 1
        if ok is None:
            return
        if ok:
            self.backend.served += 1
        else:
            self.backend.failures += 1
        if not self.backend.removed:
            seconds = self.pool.metrics.backend_seconds.labels(self.pool.role.value, self.backend.url)
            seconds.observe(time.perf_counter() - self.start)


class BackendPool:
    """The servers of one role and the policy choosing among the healthy ones."""

    def __init__(
        self,
        role: Role,
        specs: Sequence[BackendSpec],
        policy: Policy,
        metrics: ProxyMetrics,
        prefix: PrefixSettings | None = None,
    ) -> None:
        self.role, self.policy, self.metrics = role, policy, metrics
        self.prefix_settings = prefix or PrefixSettings()
        self.backends = tuple(self._backend(s) for s in specs)
        self._cursor = 0

    def any_healthy(self) -> bool:
        """Whether any backend may take a new request (healthy and not draining)."""
        return any(b.available for b in self.backends)

    def has_candidate(self, exclude: Collection[Backend] = ()) -> bool:
        return any(b.available and b not in exclude for b in self.backends)

    def _in_turn(self, exclude: Collection[Backend] = ()) -> list[Backend]:
        """The available backends not in `exclude`, in round-robin order from the cursor."""
        n = len(self.backends)
        order = (self.backends[(self._cursor + i) % n] for i in range(n))
        return [b for b in order if b.available and b not in exclude]

    def peek(self) -> Backend | None:
        """The backend pick() would choose by round robin, without choosing it."""
        return next(iter(self._in_turn()), None)

    def pick(self, exclude: Collection[Backend] = (), key: PromptKey | None = None, advance: bool = True) -> Backend | None:
        """An available backend not in `exclude`, by policy (`key`: the prompt, for the prefix policy);
        None when there is none. `advance` False (a hedge): the round-robin turn stays where it was."""
        candidates = self._in_turn(exclude)
        if not candidates:
            return None
        if self.policy is Policy.PREFIX and key is not None and key.hashes:
            chosen = self._by_prefix(candidates, key)
        elif self.policy is Policy.ROUND_ROBIN:
            chosen = candidates[0]
        else:  # least outstanding; a prefix policy without a key
            chosen = min(candidates, key=lambda b: b.outstanding)  # ties: round-robin order
        if advance:
            self._cursor = (self.backends.index(chosen) + 1) % len(self.backends)
        return chosen

    def _by_prefix(self, candidates: list[Backend], key: PromptKey) -> Backend:
        """The longest match (ties: fewest in flight, then round robin), unless load is imbalanced or no
        backend has seen the prompt's first chunk (then the fewest in flight). The prompt is remembered
        for the one chosen."""
        chosen, matched, result = self._prefer(candidates, key)
        if chosen.prefix is not None:
            chosen.prefix.insert(key)
        self.metrics.prefix_decisions.labels(self.role.value, result).inc()
        self.metrics.prefix_matched_share.labels(self.role.value).observe(key.covered_fraction(matched))
        return chosen

    def _prefer(self, candidates: list[Backend], key: PromptKey) -> tuple[Backend, int, str]:
        """The prefix policy's choice among candidates, without making it: (backend, its matched chunks
        counted in the decision, "hit" | "miss" | "balance")."""
        loads = [b.outstanding for b in candidates]
        low, high = min(loads), max(loads)
        settings = self.prefix_settings
        if high - low > settings.balance_abs and high > settings.balance_rel * low:
            return min(candidates, key=lambda b: b.outstanding), 0, "balance"
        matches = [b.prefix.match(key) if b.prefix is not None else 0 for b in candidates]
        matched = max(matches)
        best = [b for b, m in zip(candidates, matches) if m == matched]
        return min(best, key=lambda b: b.outstanding), matched, "hit" if matched else "miss"

    def expected_match(self, key: PromptKey) -> float:
        """The share of the prompt seen by the backend pick() would choose now (0 without the prefix
        policy): what that backend has cached, where a local prefill would run."""
        candidates = self._in_turn()
        if self.policy is not Policy.PREFIX or not key.hashes or not candidates:
            return 0.0
        chosen, _, _ = self._prefer(candidates, key)
        return key.covered_fraction(chosen.prefix.match(key)) if chosen.prefix is not None else 0.0

    # -- fleet changes (the admin endpoints); the tuple is replaced, never changed, so iterations stay valid --

    def find(self, url: str) -> Backend | None:
        return next((b for b in self.backends if b.url == url), None)

    def _backend(self, spec: BackendSpec) -> Backend:
        """A backend of this pool (healthy, not draining: its gauges say so from now on); with the prefix
        policy its cache, learned from its KV events where it names a publisher (start_events listens)."""
        settings = self.prefix_settings
        prefix: PrefixCache | EventPrefixCache | None = None
        events = None
        if self.policy is Policy.PREFIX:
            prefix = PrefixCache(settings.capacity)
            if spec.kv_events:
                prefix = EventPrefixCache(settings.chunk_tokens, settings.capacity, prefix)
                events = EventSubscriber(spec.kv_events, prefix, f"{self.role.value} {spec.url}")
        self.metrics.backend_healthy.labels(self.role.value, spec.url).set(1)
        self.metrics.backend_draining.labels(self.role.value, spec.url).set(0)
        return Backend(self.role, spec.url, spec.side_channel, prefix=prefix, events=events)

    def start_events(self) -> None:
        """Subscribe to every KV event publisher named (the app's start-up)."""
        for b in self.backends:
            if b.events is not None:
                b.events.start()

    def close_events(self) -> None:
        for b in self.backends:
            if b.events is not None:
                b.events.close()

    def add(self, spec: BackendSpec) -> Backend:
        """A new backend, in rotation at once (the health checker checks it from its next round)."""
        backend = self._backend(spec)
        self.backends = (*self.backends, backend)
        logger.info("%s %s added", self.role.value, backend.url)
        return backend

    def remove(self, backend: Backend) -> None:
        """Out of the pool; requests in flight on it finish (they hold the Backend)."""
        self.backends = tuple(b for b in self.backends if b is not backend)
        backend.removed = True
        if backend.events is not None:
            backend.events.close()
        m = self.metrics
        for series in (m.backend_healthy, m.backend_draining, m.backend_requests, m.backend_seconds):
            try:
                series.remove(self.role.value, backend.url)
            except KeyError:  # never observed (no request went to it)
                pass
        logger.info("%s %s removed (%d requests still in flight)", self.role.value, backend.url, backend.outstanding)

    def set_draining(self, backend: Backend, draining: bool) -> None:
        backend.draining = draining
        if not backend.removed:
            self.metrics.backend_draining.labels(self.role.value, backend.url).set(1 if draining else 0)
        logger.info("%s %s %s", self.role.value, backend.url, "draining" if draining else "back in rotation (drain ended)")

    def begin(self, backend: Backend) -> BackendCall:
        return BackendCall(self, backend)

    def mark_failed(self, backend: Backend, reason: str) -> None:
        """Passive health: a request to it failed at the connection level; out of rotation at once."""
        self._set_health(backend, False, reason)

    def record_check(self, backend: Backend, error: str | None, unhealthy_after: int) -> None:
        """One active check's result: evict after `unhealthy_after` failures in a row, restore on success."""
        if backend not in self.backends:
            return  # removed while the round ran
        if error is None:
            backend.consecutive_check_failures = 0
            self._set_health(backend, True, "health check answered")
            return
        backend.consecutive_check_failures += 1
        backend.failures += 1
        if backend.consecutive_check_failures >= unhealthy_after:
            self._set_health(backend, False, f"{backend.consecutive_check_failures} failed health checks ({error})")

    def _set_health(self, backend: Backend, healthy: bool, reason: str) -> None:
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        if healthy:
            backend.evicted.clear()
        else:
            backend.evicted.set()  # wakes the requests in flight on it (flows: a prefill goes elsewhere)
        if not backend.removed:
            self.metrics.backend_healthy.labels(self.role.value, backend.url).set(1 if healthy else 0)
        if healthy:
            logger.info("%s %s back in rotation: %s", self.role.value, backend.url, reason)
        else:
            self.metrics.evictions.labels(self.role.value).inc()
            logger.warning("%s %s evicted: %s", self.role.value, backend.url, reason)


class HealthChecker:
    """GET /health of every backend each interval (with a timeout); results go to the pools."""

    def __init__(
        self,
        pools: Sequence[BackendPool],
        client: Callable[[], httpx.AsyncClient],
        interval_s: float,
        timeout_s: float,
        unhealthy_after: int,
    ) -> None:
        self.pools, self.client = pools, client
        self.interval_s, self.timeout_s, self.unhealthy_after = interval_s, timeout_s, unhealthy_after

    async def _probe(self, backend: Backend) -> str | None:
        try:
            resp = await self.client().get(backend.url + "/health", timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - httpx's errors, or what it lets through from below
            return f"{type(exc).__name__}: {exc}"
        return None if resp.status_code == 200 else f"HTTP {resp.status_code}"

    async def check_once(self) -> None:
        pairs = [(pool, b) for pool in self.pools for b in pool.backends]
        results = await asyncio.gather(*(self._probe(b) for _, b in pairs))
        for (pool, backend), error in zip(pairs, results):
            pool.record_check(backend, error, self.unhealthy_after)

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - the checker must outlive any one bad round
                logger.exception("health check round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
