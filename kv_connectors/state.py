"""Per-request transfer state with deadlines: P's leases on blocks held for D, D's receive tasks."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

# How long a D notification may precede the P worker learning of the request (seconds).
_EARLY_NOTICE_TTL_S = 600.0


@dataclasses.dataclass
class _Lease:
    block_ids: tuple[int, ...]
    deadline: float


class SendLeases:
    """P side: blocks held for a D that will read them; freed on its notice or when the lease expires.

    A notice may arrive before the lease is added (D can be faster than P's next step): it is
    remembered and completes the lease as soon as it is added.
    """

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._early: dict[str, float] = {}  # request id -> time the notice arrived
        self._finished: set[str] = set()
        self.completed = 0
        self.expired = 0

    def add(self, request_id: str, block_ids: tuple[int, ...], now: float, lease_s: float) -> None:
        if request_id in self._early:
            del self._early[request_id]
            self._finished.add(request_id)
            self.completed += 1
            return
        self._leases[request_id] = _Lease(tuple(block_ids), now + lease_s)

    def block_ids(self, request_id: str) -> tuple[int, ...] | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.block_ids

    def hold(self, request_id: str) -> None:
        """Never expire while a write from these blocks is in flight (the write has its own deadline)."""
        self._leases[request_id].deadline = float("inf")

    def notice(self, request_id: str, now: float) -> None:
        """D is done with the request's blocks."""
        if self._leases.pop(request_id, None) is not None:
            self._finished.add(request_id)
            self.completed += 1
        elif request_id not in self._finished:
            self._early[request_id] = now

    def take_finished(self, now: float) -> tuple[set[str], set[str]]:
        """(completed, expired) request ids since the last call; both are to be freed."""
        expired = {rid for rid, lease in self._leases.items() if lease.deadline <= now}
        for rid in expired:
            del self._leases[rid]
        self.expired += len(expired)
        for rid in [rid for rid, t in self._early.items() if now - t > _EARLY_NOTICE_TTL_S]:
            del self._early[rid]
        done, self._finished = self._finished, set()
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
