"""Rate-limited logging for anything a peer (or a bug repeating every step) can trigger."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """At most one record per key every interval_s; the next one says how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, max_keys: int = 1024) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last emitted, suppressed since)

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (float("-inf"), 0))
            if now - last < self._interval_s:
                self._last[key] = (last, suppressed + 1)
                return
            self._last.pop(key, None)
            self._last[key] = (now, 0)
            while len(self._last) > self._max_keys:
                del self._last[next(iter(self._last))]
        if suppressed:
            msg += " (%d more like this suppressed)"
            args = (*args, suppressed)
        self._logger.log(level, msg, *args, exc_info=exc_info)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def exception(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.ERROR, key, msg, *args, exc_info=True)
