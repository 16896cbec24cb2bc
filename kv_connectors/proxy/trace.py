"""One client request's record: backends chosen, retries, timings; one log line and one counter when it ends."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from .config import Role
from .errors import Outcome
from .metrics import ProxyMetrics

logger = logging.getLogger("kv_connectors.proxy")


class Mode(str, enum.Enum):
    """How a prompt was served (the `mode` of its log line)."""

    DISAGGREGATED = "pd"  # P's KV handed to D
    LOCAL = "local"  # D alone by choice: a prompt too short to be worth a transfer
    FALLBACK = "fallback"  # D alone because no P was left


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


@dataclass
class Trace:
    request_id: str
    route: str
    metrics: ProxyMetrics
    start: float = field(default_factory=time.perf_counter)
    chosen: dict[Role, list[str]] = field(default_factory=lambda: {Role.PREFILL: [], Role.DECODE: []})
    retries: int = 0
    prefill_s: float | None = None  # first P answer
    first_byte_s: float | None = None  # first byte from D (the whole answer when not streaming)
    outcome: Outcome = Outcome.OK
    mode: Mode = Mode.DISAGGREGATED
    seeded: bool = False  # the client's first token came from P (first token from prefill)
    hedge: str = "-"  # a prefill was hedged: "won" (the second P's answer was used) or "lost"
    finished: bool = False

    def chose(self, role: Role, url: str) -> None:
        self.chosen[role].append(url)

    def failed(self, role: Role, url: str) -> None:
        """Marks the latest use of `url` as failed ('!' in the log line)."""
        urls = self.chosen[role]
        for i in range(len(urls) - 1, -1, -1):
            if urls[i] == url:
                urls[i] = url + "!"
                return

    def prefill_answered(self) -> None:
        if self.prefill_s is None:
            self.prefill_s = time.perf_counter() - self.start

    def decode_first_byte(self, streaming: bool) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = time.perf_counter() - self.start
            if streaming:
                self.metrics.ttft.observe(self.first_byte_s)

    def finish(self, status: int) -> None:
        """Log the request's line and count it; only the first call counts."""
        if self.finished:
            return
        self.finished = True
        self.metrics.requests.labels(self.route, self.outcome.value).inc()
        logger.info(
            "request %s %s mode=%s seeded=%s P=%s D=%s retries=%d status=%d outcome=%s p_answer=%s d_first_byte=%s "
            "total=%.3fs hedge=%s",
            self.request_id,
            self.route,
            self.mode.value,
            "yes" if self.seeded else "no",
            ",".join(self.chosen[Role.PREFILL]) or "-",
            ",".join(self.chosen[Role.DECODE]) or "-",
            self.retries,
            status,
            self.outcome.value,
            _seconds(self.prefill_s),
            _seconds(self.first_byte_s),
            time.perf_counter() - self.start,
            self.hedge,
        )
