"""The staging pool: host memory allocated once and cut into slots, and who holds or waits for them."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from kv_connectors.layout import KVLayout, Region
from kv_connectors.transports.base import MemoryKind, Transport

logger = logging.getLogger(__name__)

PROBE_BYTES = 64  # liveness probes read one byte of the peer's pool into this registered word


@dataclasses.dataclass(eq=False)
class _Waiter:
    item: object  # what waits (the Initiator's Transfer, the Responder's Serve): for cancel()
    own: bool  # one of our transfers (counted against slots - 1) or a peer's chunk we serve
    start: Callable[[int], None]  # called with the slot's offset once granted


class SlotPool:
    """The pool (and the probe word) registered with the inner transport, its slots and their queue.

    Slots are granted first come, first served to whoever waits (`wait`): our own transfers hold at
    most slots - 1 slots, so one is always left for serving peers and two transports that stage
    towards each other cannot deadlock. A slot is an offset into the pool; `give` returns it."""

    def __init__(self, name: str, inner: Transport, pool_bytes: int, chunk_bytes: int) -> None:
        self._name = name
        self._inner = inner
        self.pool_bytes = pool_bytes
        self.chunk_bytes = chunk_bytes
        self.slots = pool_bytes // chunk_bytes
        self.tensor: Any = None  # torch.Tensor once allocated; never grows
        self._probe_word: Any = None
        self.base = 0
        self.kind = MemoryKind.HOST
        self.device_id = 0
        self._free: collections.deque[int] = collections.deque(k * chunk_bytes for k in range(self.slots))
        self._own = 0  # slots held by our own transfers (at most slots - 1)
        self.peak = 0
        self._queue: collections.deque[_Waiter] = collections.deque()

    @property
    def allocated(self) -> bool:
        return self.tensor is not None

    @property
    def probe_addr(self) -> int:
        """Address of the registered word liveness probes read into."""
        return int(self._probe_word.data_ptr())

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def allocate(self, kind: MemoryKind, device_id: int) -> None:
        """Allocate the pool (pinned for device KV memory) and register it, and only it, with the inner transport."""
        import torch

        pin = kind is MemoryKind.DEVICE and torch.cuda.is_available()  # pinned: copies to it are async DMA
        pool = torch.empty(self.pool_bytes, dtype=torch.uint8, pin_memory=pin)
        probe = torch.zeros(PROBE_BYTES, dtype=torch.uint8)
        base = pool.data_ptr()
        regions = (Region(base, self.pool_bytes, self.pool_bytes, 1), Region(probe.data_ptr(), PROBE_BYTES, PROBE_BYTES, 1))
        self._inner.register(KVLayout(num_blocks=1, block_size=1, regions=regions), MemoryKind.HOST, 0)
        self.tensor, self._probe_word, self.base = pool, probe, base
        self.kind, self.device_id = kind, device_id
        logger.info(
            "staging %s: %d-byte host pool (%d slots of %d bytes, pinned=%s) for %s KV memory",
            self._name,
            self.pool_bytes,
            self.slots,
            self.chunk_bytes,
            pin,
            kind.value,
        )

    def free_memory(self) -> None:
        self.tensor = self._probe_word = None

    def wait(self, item: object, own: bool, start: Callable[[int], None]) -> None:
        """Queue for a slot (at the back); `start(slot)` runs once one is granted (see grant)."""
        self._queue.append(_Waiter(item, own, start))

    def cancel(self, match: Callable[[object], bool]) -> None:
        """Drop the waiters whose item matches."""
        self._queue = collections.deque(w for w in self._queue if not match(w.item))

    def grant(self) -> None:
        """Hand free slots to waiters in arrival order (our own transfers only up to slots - 1)."""
        while self._free and self._queue:
            pick = next((i for i, w in enumerate(self._queue) if not w.own or self._own < self.slots - 1), None)
            if pick is None:
                return
            waiter = self._queue[pick]
            del self._queue[pick]
            waiter.start(self._take(waiter.own))

    def give(self, slot: int | None, own: bool) -> None:
        """Return a slot taken for our own transfer (own) or for serving a peer."""
        assert slot is not None
        self._free.append(slot)
        self._own -= own

    def _take(self, own: bool) -> int:
        slot = self._free.popleft()
        self._own += own
        self.peak = max(self.peak, self.in_use)
        return slot
