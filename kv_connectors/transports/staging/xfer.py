"""Records of staging: the handle callers hold (StagedXfer), the initiator's bookkeeping of one
transfer (Transfer, Chunk, Phase) and the responder's of one chunk it serves (Serve)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from kv_connectors.errors import TransportError
from kv_connectors.transports.base import Op, Transport, XferState
from kv_connectors.transports.staging.chunks import Chunks


@dataclasses.dataclass(eq=False)
class StagedXfer:
    """Handle of one staged transfer (returned by post_read/post_write; pass it to poll/release).

    `state` and `error` are set by the transport (the Initiator) as the transfer progresses."""

    peer_name: str
    op: Op
    num_runs: int
    nbytes: int
    num_chunks: int
    chunks_done: int = 0
    id: int = 0
    state: XferState = XferState.IN_PROGRESS
    error: TransportError | None = None


class Phase(enum.Enum):
    WAIT_READY = "wait_ready"  # READ: STAGE sent, our slot is held
    READING = "reading"  # READ: inner READ from the peer's slot into ours
    WAIT_SLOT = "wait_slot"  # WRITE: gathered into our slot, WANT sent
    WRITING = "writing"  # WRITE: inner WRITE from our slot into the peer's
    WAIT_SCATTERED = "wait_scattered"  # WRITE: our slot is free, the peer has yet to scatter


@dataclasses.dataclass(eq=False)
class Chunk:
    index: int
    slot: int | None  # offset of our slot in the pool; None once freed
    nbytes: int
    phase: Phase
    remote_off: int = -1
    inner: Any = None  # inner handle while an inner op is in flight
    scattered: bool = False


@dataclasses.dataclass(frozen=True)
class Drain:
    """An inner op of a failed transfer, polled to its end before its slot is reused."""

    inner: Any
    slot: int | None
    deadline: float


@dataclasses.dataclass(eq=False)
class Transfer:
    """The Initiator's bookkeeping of one of our transfers (the caller holds `handle`)."""

    handle: StagedXfer
    chunks: Chunks
    notif: bytes
    next: int = 0  # the next chunk to start
    active: dict[int, Chunk] = dataclasses.field(default_factory=dict)
    draining: list[Drain] = dataclasses.field(default_factory=list)

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def peer(self) -> str:
        return self.handle.peer_name

    @property
    def op(self) -> Op:
        return self.handle.op


@dataclasses.dataclass(eq=False)
class Serve:
    """A peer's chunk we serve: queued for a slot, then holding one until FREE / SCATTER."""

    peer: str
    xfer: int
    chunk: int
    op: Op  # READ (we gather, the peer reads) or WRITE (the peer writes, we scatter)
    nbytes: int
    runs: bytes = b""
    slot: int = -1


def settle(inner: Transport, handle: Any) -> XferState | TransportError:
    """Poll an inner op; one that has ended (DONE, or failed: its error is returned) is released."""
    try:
        state = inner.poll(handle)
    except TransportError as e:
        inner.release(handle)
        return e
    if state is XferState.DONE:
        inner.release(handle)
    return state
