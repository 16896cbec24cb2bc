"""Empty engine steps that wait briefly for the connector's next event instead of spinning.

vLLM steps back to back while a request waits on the connector (P holding blocks for a D, D waiting
for a load), even when it schedules no token: measured here, ~800 empty steps a second, each ~0.45 ms
of CPU between the engine and the API server (scheduler stats every step), and the engine thread
holding the GIL that the side-channel threads of the same process need to answer claims and
handshakes. After an empty step that finished nothing, the worker waits here: until a side-channel
message or reply the engine acts on wakes it, or for a delay that doubles with each consecutive empty
step, from MIN_WAIT_S up to the configured cap (shorter while a transfer is in flight, whose
completion only polling sees); while an answer that wakes it is on its way (a claim, a handshake),
the whole cap at once. A new request reaching vLLM meanwhile waits at most that cap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

MIN_WAIT_S = 0.0001  # the first empty step's wait; doubled per consecutive empty step


class IdlePacer:
    """The wait between empty steps. Thread-safe: wake() is called from side-channel threads."""

    def __init__(self, max_wait_s: float, wait: Callable[[float], bool] | None = None) -> None:
        """max_wait_s: the longest wait (0: never wait, vLLM spins as it does without us); wait: the
        blocking wait (an Event's by default; tests record it instead)."""
        self._max = max(0.0, max_wait_s)
        self._event = threading.Event()
        self._wait = wait or self._event.wait
        self._next = MIN_WAIT_S
        self.waits = 0  # how many empty steps waited

    @property
    def enabled(self) -> bool:
        return self._max > 0

    def wake(self) -> None:
        """Something the engine acts on has happened (another thread): end the current wait."""
        self._event.set()

    @property
    def woken(self) -> bool:
        """A wake came since the last arm()."""
        return self._event.is_set()

    def arm(self) -> None:
        """Called before the engine looks at its state: a wake from now on ends the next wait."""
        self._event.clear()

    def reset(self) -> None:
        """A step did work: the next empty step starts again from the shortest wait."""
        self._next = MIN_WAIT_S

    def pause(self, cap_s: float, awaiting: bool = False) -> bool:
        """Wait up to min(the current delay, cap_s, the configured cap); True if woken. awaiting: an
        answer that will wake us is on its way: wait for it up to the caps, whatever the delay."""
        delay = min(cap_s, self._max) if awaiting else min(self._next, cap_s, self._max)
        if delay <= 0:
            return False
        self._next = min(self._next * 2, self._max)
        self.waits += 1
        woken = bool(self._wait(delay))
        if woken:
            self._next = MIN_WAIT_S
        return woken
