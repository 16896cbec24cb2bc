"""The worker engine as vLLM sees it: the pure WorkerEngine plus our counters in vLLM's stats type."""

from __future__ import annotations

from typing import Any

from kv_connectors.vllm.stats import IntervalStats, KvcStats
from kv_connectors.worker import WorkerEngine


class WorkerSide(WorkerEngine):
    """WorkerEngine with per-interval KvcStats for vLLM's metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._interval = IntervalStats()

    def take_interval_stats(self) -> KvcStats | None:
        """Counters since the last call, for vLLM's metrics (None when nothing changed)."""
        return self._interval.take(self.stats, self.take_load_durations(), self.take_phase_durations())
