"""Hedged prefills ("The Tail at Scale"): a prefill still unanswered after the pool's usual time goes to a
second P as well; the first answer is used and the other request cancelled (vLLM aborts it and frees its
blocks). A frozen or overloaded P then costs its requests the hedge delay, not the health checks' eviction
or P's deadline. The delay adapts to the pool (a multiple of the p90 of its recent prefills) unless set,
and a budget bounds the extra prefills to a share of the recent ones."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .backends import Backend
from .config import HedgeSettings, Role
from .errors import FailureKind, UpstreamFailure
from .upstream import cancel_task

logger = logging.getLogger("kv_connectors.proxy")

T = TypeVar("T")
EVICTED_DURING_PREFILL = "was evicted by its health checks during the prefill"


class HedgePolicy:
    """One pool's hedge delay (from its recent prefills' durations) and budget (from its recent starts),
    and which of its backends are silent: a hedge answered before them, and no answer of theirs has come
    since (a frozen P). A prefill on a silent backend is hedged outside the budget: the hedge is not extra
    work when the first request is not being served, and a live backend answers soon and is silent no more."""

    def __init__(self, settings: HedgeSettings) -> None:
        self.settings = settings
        self._durations: deque[float] = deque(maxlen=settings.window)  # answered prefills, seconds
        self._starts: deque[bool] = deque(maxlen=settings.window)  # one a prefill request sent: a hedge?
        self._silent: set[str] = set()  # backend URLs a hedge beat, with no answer of theirs since

    def answered(self, backend: Backend, seconds: float) -> None:
        self._durations.append(seconds)
        self._silent.discard(backend.url)

    def beaten(self, backend: Backend) -> None:
        """A hedge answered while `backend` had not."""
        self._silent.add(backend.url)

    def silent(self, backend: Backend) -> bool:
        return backend.url in self._silent

    def started(self, hedge: bool) -> None:
        self._starts.append(hedge)

    def delay_s(self) -> float | None:
        """How long a prefill may go unanswered before it is hedged; None: not hedged (off, or too few
        answers seen to know the pool's usual time)."""
        s = self.settings
        if not s.enabled:
            return None
        if s.after_s is not None:
            return s.after_s
        if len(self._durations) < s.min_samples:
            return None
        seen = list(self._durations)
        p90 = statistics.quantiles(seen, n=10, method="inclusive")[-1] if len(seen) > 1 else seen[0]
        return max(s.floor_s, s.factor * p90)

    def may_hedge(self) -> bool:
        """Within the budget: the recent hedges, this one included, are at most its share of the recent
        prefills, plus one (a fleet that has just started may hedge once)."""
        hedges = sum(self._starts)
        return hedges + 1 <= self.settings.budget * (len(self._starts) - hedges) + 1


class _Leg(Generic[T]):
    """One prefill request of a race: its backend, its task, when it started, whether it is the hedge, and
    a waiter on its backend's eviction (None once that is no longer watched)."""

    def __init__(self, backend: Backend, run: Callable[[Backend], Awaitable[T]], hedge: bool) -> None:
        self.backend, self.hedge = backend, hedge
        self.task: asyncio.Future[T] = asyncio.ensure_future(run(backend))
        self.start = time.perf_counter()
        self.evicted: asyncio.Future[Any] | None = asyncio.ensure_future(backend.evicted.wait())

    def unwatch(self) -> None:
        if self.evicted is not None:
            self.evicted.cancel()
            self.evicted = None


@dataclass(frozen=True)
class Won(Generic[T]):
    """The answer a race took, its backend, and whether a hedge was sent (`hedged`) and answered first."""

    backend: Backend
    answer: T
    hedged: bool
    by_hedge: bool


async def race(
    first: Backend,
    run: Callable[[Backend], Awaitable[T]],
    policy: HedgePolicy,
    hedge_to: Callable[[], Backend | None],
    may_leave: Callable[[Backend], bool],
    failed: Callable[[Backend, UpstreamFailure], None],
) -> Won[T]:
    """The first answer of `run` on `first`, or on a second backend (`hedge_to`, asked once the policy's
    delay passes, within its budget) if that one answers first; the other request is cancelled.

    A request whose backend is evicted by the health checks is cancelled when another request still runs
    or `may_leave` says the prompt could go elsewhere (else it is waited for: P may resume). Each failed
    request is reported to `failed`; when none is left the last failure is raised (the caller retries)."""
    legs = [_Leg(first, run, hedge=False)]
    policy.started(hedge=False)
    delay_s = policy.delay_s()
    timer = asyncio.ensure_future(asyncio.sleep(delay_s)) if delay_s is not None else None
    hedged = False
    last: UpstreamFailure | None = None
    try:
        while legs:
            waits: set[asyncio.Future[Any]] = {leg.task for leg in legs}
            waits |= {leg.evicted for leg in legs if leg.evicted is not None}
            if timer is not None:
                waits.add(timer)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for leg in [leg for leg in legs if leg.task in done]:
                legs.remove(leg)
                leg.unwatch()
                exc = leg.task.exception()
                if exc is None:
                    policy.answered(leg.backend, time.perf_counter() - leg.start)
                    if leg.hedge and legs:
                        policy.beaten(legs[0].backend)
                    return Won(leg.backend, leg.task.result(), hedged, by_hedge=leg.hedge)
                if not isinstance(exc, UpstreamFailure):
                    raise exc
                failed(leg.backend, exc)
                last = exc
            for leg in [leg for leg in legs if leg.evicted is not None and leg.evicted in done]:
                leg.evicted = None
                if len(legs) > 1 or may_leave(leg.backend):
                    legs.remove(leg)
                    await cancel_task(leg.task)
                    last = UpstreamFailure(Role.PREFILL, leg.backend.url, FailureKind.EVICTED, EVICTED_DURING_PREFILL)
                    failed(leg.backend, last)
            if timer is not None and timer in done:
                timer = None
                free = bool(legs) and policy.silent(legs[0].backend)  # not extra work: outside the budget
                second = hedge_to() if legs and (free or policy.may_hedge()) else None
                if second is not None:
                    logger.info(
                        "prefill on %s unanswered after %.2f s%s: hedged on %s",
                        legs[0].backend.url,
                        delay_s,
                        " (silent: its last answers came from hedges)" if free else "",
                        second.url,
                    )
                    if not free:
                        policy.started(hedge=True)
                    hedged = True
                    legs.append(_Leg(second, run, hedge=True))
        assert last is not None
        raise last
    finally:
        for leg in legs:
            leg.unwatch()
            await cancel_task(leg.task)
        if timer is not None:
            timer.cancel()
