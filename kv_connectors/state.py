"""Per-request transfer state with deadlines: P's leases on blocks held for D, D's receive tasks."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

# How long a D notification may precede the P worker learning of the request (seconds).
_EARLY_NOTICE_TTL_S = 600.0


@dataclasses.dataclass
class _Lease:
    request_id: str  # vLLM's id of P's request: what is reported when the blocks may be freed
    block_ids: tuple[int, ...]
    deadline: float


class SendLeases:
    """P side: blocks held for a D that will read them; freed on its notice or when the lease expires.

    Leases are keyed by what D names them by: P's request id, or the transfer id the request
    came with. A notice may arrive before the lease is added (D can be faster than P's next
    step, and in the transfer-id flow D may be done before P computed anything): it is
    remembered and completes the lease as soon as it is added.
    """

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._early: dict[str, float] = {}  # key -> time the notice arrived
        self._finished: set[str] = set()  # request ids
        self._finished_keys: set[str] = set()
        self.completed = 0
        self.expired = 0

    def add(self, key: str, request_id: str, block_ids: tuple[int, ...], now: float, lease_s: float) -> None:
        if key in self._early:
            del self._early[key]
            self._finished.add(request_id)
            self._finished_keys.add(key)
            self.completed += 1
            return
        self._leases[key] = _Lease(request_id, tuple(block_ids), now + lease_s)

    def block_ids(self, key: str) -> tuple[int, ...] | None:
        lease = self._leases.get(key)
        return None if lease is None else lease.block_ids

    def hold(self, key: str) -> None:
        """Never expire while a write from these blocks is in flight (the write has its own deadline)."""
        self._leases[key].deadline = float("inf")

    def notice(self, key: str, now: float) -> None:
        """D is done with the blocks held under key."""
        lease = self._leases.pop(key, None)
        if lease is not None:
            self._finished.add(lease.request_id)
            self._finished_keys.add(key)
            self.completed += 1
        elif key not in self._finished_keys:
            self._early[key] = now

    def take_finished(self, now: float) -> tuple[set[str], set[str]]:
        """(completed, expired) request ids since the last call; both are to be freed."""
        expired_keys = [key for key, lease in self._leases.items() if lease.deadline <= now]
        expired = {self._leases.pop(key).request_id for key in expired_keys}
        self.expired += len(expired)
        for key in [key for key, t in self._early.items() if now - t > _EARLY_NOTICE_TTL_S]:
            del self._early[key]
        done, self._finished = self._finished, set()
        self._finished_keys.clear()
        return done, expired

    @property
    def held_requests(self) -> int:
        return len(self._leases)

    @property
    def held_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())


class RecvPhase(enum.Enum):
    """Where a D-side receive stands."""

    HANDSHAKE = "handshake"  # waiting for the peer's metadata
    REQUESTED = "requested"  # push: waiting for P to accept the push request
    TRANSFER = "transfer"  # a READ is posted, or (push) waiting for P's notification
    DONE = "done"
    FAILED = "failed"


@dataclasses.dataclass
class RecvTask:
    """One request's load of remote blocks into local blocks, with a deadline for each phase."""

    request_id: str
    peer_key: tuple[str, str, int]  # (engine id, host, port)
    remote_request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    deadline: float
    phase: RecvPhase = RecvPhase.HANDSHAKE
    handle: Any = None
    error: str | None = None
    started: float = 0.0
    num_bytes: int = 0
    num_descriptors: int = 0

    def fail(self, error: str) -> None:
        self.phase = RecvPhase.FAILED
        self.error = error
