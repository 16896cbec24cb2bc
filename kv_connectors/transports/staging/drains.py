"""Our failed staged transfers' inner ops, polled to their end before their slots are reused; then the peer is told."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kv_connectors.errors import TransportError
from kv_connectors.transports.base import Transport
from kv_connectors.transports.staging.messages import Error, error_kind
from kv_connectors.transports.staging.outbox import Outbox
from kv_connectors.transports.staging.pool import SlotPool
from kv_connectors.transports.staging.xfer import Drain, StagedXfer, Transfer

logger = logging.getLogger(__name__)


class Drains:
    """A failed transfer's slots: an idle one goes back to the pool at once; one under an inner op
    still in flight only once the inner transport says no byte of the op can move (a released op may
    still land: UCX, Mooncake). One that does not end within drain_timeout_s keeps its slot out of the
    pool (quarantined). The peer hears of the failure (ERROR) only once none is left, so no late write
    of ours lands in a slot it reused."""

    def __init__(
        self,
        name: str,
        inner: Transport,
        *,
        pool: SlotPool,
        outbox: Outbox,
        drain_timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._name = name
        self._inner = inner
        self._pool = pool
        self._outbox = outbox
        self._drain_timeout = drain_timeout_s
        self._clock = clock
        self._aborting: list[Transfer] = []  # failed transfers whose inner ops are still draining
        self._aborted: set[int] = set()  # id() of inner ops told to abort
        self._quarantined: set[int] = set()  # slots of inner ops that did not end in drain_timeout_s

    @property
    def quarantined_slots(self) -> int:
        return len(self._quarantined)

    def draining(self, handle: StagedXfer) -> bool:
        """Whether inner ops of that (failed) transfer may still move bytes."""
        return any(t.handle is handle for t in self._aborting)

    def start(self, t: Transfer) -> None:
        """Take a transfer that just failed: its chunks' idle slots freed, their inner ops drained."""
        deadline = self._clock() + self._drain_timeout
        for c in t.active.values():
            if c.inner is not None:
                t.draining.append(Drain(c.inner, c.slot, deadline))
            elif c.slot is not None:
                self._pool.give(c.slot, True, t.peer)
        t.active.clear()
        self._aborting.append(t)
        self._drain(t)  # the peer hears of it once no write of ours can land in its slots

    def poll(self) -> None:
        for t in list(self._aborting):
            self._drain(t)

    def _abort_once(self, inner: object) -> None:
        if id(inner) not in self._aborted:
            self._aborted.add(id(inner))
            self._inner.abort(inner)

    def _drain(self, t: Transfer) -> None:
        keep = []
        now = self._clock()
        for d in t.draining:
            self._abort_once(d.inner)
            if not self._inner.settled(d.inner):
                if now > d.deadline and d.slot is not None and d.slot not in self._quarantined:
                    self._quarantined.add(d.slot)
                    logger.error(
                        "staging %s: a failed %s with %s has not ended after %.0f s; its slot stays out of the pool",
                        self._name,
                        t.op,
                        t.peer,
                        self._drain_timeout,
                    )
                keep.append(d)
                continue
            self._aborted.discard(id(d.inner))
            self._inner.release(d.inner)
            if d.slot is not None:
                self._quarantined.discard(d.slot)
                self._pool.give(d.slot, True, t.peer)
        t.draining = keep
        if not keep:
            self._aborting.remove(t)
            err = t.handle.error or TransportError("aborted")
            self._outbox.send(t.peer, Error(t.id, False, error_kind(err), str(err)))
