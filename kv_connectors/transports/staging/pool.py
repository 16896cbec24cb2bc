"""The staging pool: host memory allocated once and cut into slots, and who holds or waits for them."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from kv_connectors.errors import ConfigError
from kv_connectors.layout import KVLayout, Region
from kv_connectors.transports.base import MemoryKind, Transport

logger = logging.getLogger(__name__)

PROBE_BYTES = 64  # liveness probes read one byte of the peer's pool into this registered word


@dataclasses.dataclass(eq=False)
class _Waiter:
    item: object  # what waits (the Initiator's Transfer, the Responder's Serve): for cancel()
    own: bool  # one of our transfers (counted against slots - 1) or a peer's chunk we serve
    peer: str  # the peer the slot is for (our transfer's, or the one whose chunk we serve)
    start: Callable[[int], None]  # called with the slot's offset once granted


def default_peer_cap(slots: int) -> int:
    """Slots we hold serving one peer: half the pool, at least 1. A peer that stops (SIGSTOP, a hung
    engine) keeps what it holds until it answers or is confirmed gone (a slot it may still read or
    write cannot be handed on), so one stopped peer leaves at least half the pool to the others and
    to our own transfers; half still lets a lone peer pipeline slots / 2 chunks (8 at the default
    16 slots, more than its gather -> move -> scatter stages keep busy). Peers the peer table calls
    suspect get no new slot at all, so a few stopped peers hold only what they had at the time."""
    return max(1, slots // 2)


class SlotPool:
    """The pool (and the probe word) registered with the inner transport, its slots and their queue.

    Slots are granted first come, first served to whoever waits (`wait`): our own transfers hold at
    most slots - 1 slots, so one is always left for serving peers and two transports that stage
    towards each other cannot deadlock; we hold at most `peer_cap` slots serving any one peer (its
    further chunks wait in the queue); and for a peer `granting` refuses (a suspect peer) nothing is
    granted but one chunk of ours at a time. A slot is an offset into the pool; `give` returns it."""

    def __init__(
        self,
        name: str,
        inner: Transport,
        pool_bytes: int,
        chunk_bytes: int,
        *,
        peer_cap: int | None = None,
        granting: Callable[[str], bool] = lambda peer: True,
    ) -> None:
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
        self.peer_cap = default_peer_cap(self.slots) if peer_cap is None else peer_cap
        if self.peer_cap < 1:
            raise ConfigError(f"staging {name}: a peer must be served at least 1 slot, got {peer_cap}")
        self._held: collections.Counter[tuple[bool, str]] = collections.Counter()  # slots held by (own, peer)
        self._granting = granting
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

    def wait(self, item: object, own: bool, peer: str, start: Callable[[int], None]) -> None:
        """Queue for a slot (at the back); `start(slot)` runs once one is granted (see grant)."""
        self._queue.append(_Waiter(item, own, peer, start))

    def cancel(self, match: Callable[[object], bool]) -> list[object]:
        """Drop the waiters whose item matches; returns their items."""
        dropped = [w.item for w in self._queue if match(w.item)]
        if dropped:
            self._queue = collections.deque(w for w in self._queue if not match(w.item))
        return dropped

    def grant(self) -> None:
        """Hand free slots to waiters in arrival order, skipping those that may not have one now
        (our own transfers beyond slots - 1, a peer's chunks beyond its cap, a suspect peer's chunks;
        our own with a suspect peer one chunk at a time: a live peer answers it and is live again,
        so a suspicion that outlived what the peer owed us does not stall every later transfer)."""
        while self._free and self._queue:
            pick = next((i for i, w in enumerate(self._queue) if self._may_take(w)), None)
            if pick is None:
                return
            waiter = self._queue[pick]
            del self._queue[pick]
            waiter.start(self._take(waiter))

    def give(self, slot: int | None, own: bool, peer: str) -> None:
        """Return a slot taken for our own transfer with `peer` (own) or for serving `peer`."""
        assert slot is not None
        self._free.append(slot)
        self._own -= own
        self._held[own, peer] -= 1
        if self._held[own, peer] <= 0:
            del self._held[own, peer]

    def _may_take(self, w: _Waiter) -> bool:
        held = self._held[w.own, w.peer]
        if not self._granting(w.peer):  # suspect: none for its chunks; for ours one at a time, the
            return w.own and held == 0 and self._own < self.slots - 1  # question a live peer answers
        return self._own < self.slots - 1 if w.own else held < self.peer_cap

    def _take(self, w: _Waiter) -> int:
        slot = self._free.popleft()
        self._own += w.own
        self._held[w.own, w.peer] += 1
        self.peak = max(self.peak, self.in_use)
        return slot
