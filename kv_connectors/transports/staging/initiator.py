"""Initiator side of staging: our transfers' chunk pipeline (gather or stage, pool-to-pool move, scatter)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kv_connectors.errors import TransportError
from kv_connectors.transports.base import Transport, XferState
from kv_connectors.transports.staging.chunks import one_run
from kv_connectors.transports.staging.messages import (
    ENC,
    MSG_MAGIC,
    Free,
    Msg,
    Ready,
    Scatter,
    Scattered,
    Slot,
    Stage,
    Want,
    pack_runs,
    user_bytes,
)

if TYPE_CHECKING:  # annotations only: transport.py imports this module
    from kv_connectors.transports.staging.transport import StagedXfer

logger = logging.getLogger(__name__)


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


class Initiator:
    """Mixin of StagedTransport: moving the chunks of our own transfers and handling the peer's replies.

    It keeps no state of its own; the attributes and helpers below are StagedTransport's.
    """

    _inner: Transport
    _peers: dict[str, Any]
    _pool_base: int
    _xfers: dict[int, StagedXfer]
    _waiters: collections.deque[Any]
    _send: Callable[[str, Msg], None]
    _flush: Callable[..., None]
    _copy: Callable[[np.ndarray, np.ndarray, np.ndarray], None]
    _take: Callable[..., int]
    _give: Callable[..., None]
    _grant: Callable[[], None]
    _fail: Callable[[StagedXfer, TransportError], None]
    _settle: Callable[[Any], XferState | TransportError]

    def _poll_chunk(self, x: StagedXfer, c: Chunk) -> None:
        ended = self._settle(c.inner)
        if ended is XferState.IN_PROGRESS:
            return
        c.inner = None
        if isinstance(ended, TransportError):
            self._fail(x, ended)
            return
        self._peers[x.peer_name].last_heard = time.monotonic()
        try:
            if c.phase is Phase.READING:
                self._scatter_local(x, c)
            else:
                self._give(c.slot, own=True)
                c.slot = None
                c.phase = Phase.WAIT_SCATTERED
                if c.scattered:
                    self._chunk_done(x, c)
        except TransportError as e:
            self._fail(x, e)
        self._grant()  # the freed slot starts the next chunk now: keeps the peer busy

    def _scatter_local(self, x: StagedXfer, c: Chunk) -> None:
        """READ: the chunk is in our slot; copy it into our KV cache, free both slots."""
        assert x._chunks is not None and c.slot is not None
        sl = x._chunks.pieces(c.index)
        self._copy(x._chunks.dst[sl], self._pool_base + c.slot + x._chunks.slot_off[sl], x._chunks.length[sl])
        self._give(c.slot, own=True)
        c.slot = None
        self._send(x.peer_name, Free(x._id, c.index, c.remote_off))
        self._chunk_done(x, c)

    def _chunk_done(self, x: StagedXfer, c: Chunk) -> None:
        if x._active.pop(c.index, None) is None:
            return  # the transfer failed meanwhile (e.g. while flushing messages)
        x.chunks_done += 1
        if x.chunks_done < x.num_chunks:
            return
        if x._notif:  # every chunk is in the destination KV cache: the user's notification follows
            self._flush(x.peer_name)
            try:
                self._inner.send_notif(x.peer_name, user_bytes(x._notif))
            except TransportError as e:
                self._fail(x, e)
                return
        x._state = XferState.DONE
        self._xfers.pop(x._id, None)
        logger.debug("staged %s %s done: %d bytes in %d chunks", x.op, x.peer_name, x.nbytes, x.num_chunks)

    def _start_chunk(self, x: StagedXfer) -> None:
        assert x._chunks is not None
        k = x._next
        x._next += 1
        if x._next < x.num_chunks:
            self._waiters.append(x)  # back of the queue: transfers take turns
        c = Chunk(k, self._take(own=True), x._chunks.nbytes(k), Phase.WAIT_READY)
        x._active[k] = c
        sl = x._chunks.pieces(k)
        try:
            if x.op == "READ":
                self._send(x.peer_name, Stage(x._id, k, pack_runs(x._chunks.src[sl], x._chunks.length[sl])))
            else:
                self._copy(self._pool_base + c.slot + x._chunks.slot_off[sl], x._chunks.src[sl], x._chunks.length[sl])
                c.phase = Phase.WAIT_SLOT
                self._send(x.peer_name, Want(x._id, k, c.nbytes))
        except TransportError as e:
            self._fail(x, e)

    # Message handlers: initiator side ------------------------------------------------------------
    def _mine(self, peer: str, xfer: int, chunk: int, *phases: Phase) -> tuple[StagedXfer, Chunk] | None:
        x = self._xfers.get(xfer)
        c = x._active.get(chunk) if x is not None and x.peer_name == peer else None
        return (x, c) if x is not None and c is not None and c.phase in phases else None

    def _on_ready(self, peer: str, m: Ready) -> None:
        found = self._mine(peer, m.xfer, m.chunk, Phase.WAIT_READY)
        if found is None:
            self._send(peer, Free(m.xfer, m.chunk, m.offset))  # stale: let the peer free its slot
            return
        x, c = found
        c.remote_off = m.offset
        self._post_inner(x, c, m.offset, Phase.READING, b"")

    def _on_slot(self, peer: str, m: Slot) -> None:
        found = self._mine(peer, m.xfer, m.chunk, Phase.WAIT_SLOT)
        if found is None:
            self._send(peer, Free(m.xfer, m.chunk, m.offset))
            return
        x, c = found
        assert x._chunks is not None
        sl = x._chunks.pieces(c.index)
        scatter = Scatter(x._id, c.index, m.offset, pack_runs(x._chunks.dst[sl], x._chunks.length[sl]))
        c.remote_off = m.offset
        self._post_inner(x, c, m.offset, Phase.WRITING, MSG_MAGIC + ENC.encode([scatter]))

    def _post_inner(self, x: StagedXfer, c: Chunk, remote_off: int, phase: Phase, notif: bytes) -> None:
        """Post the pool-to-pool move of one chunk between our slot and the peer's."""
        assert c.slot is not None
        info = self._peers[x.peer_name].info
        if not (0 <= remote_off and remote_off + c.nbytes <= info.pool_bytes):
            self._fail(x, TransportError(f"staging peer {x.peer_name} offered slot {remote_off} outside its pool"))
            return
        local, remote = self._pool_base + c.slot, info.pool_base + remote_off
        try:
            if phase is Phase.READING:
                c.inner = self._inner.post_read(x.peer_name, one_run(remote, local, c.nbytes), notif)
            else:
                c.inner = self._inner.post_write(x.peer_name, one_run(local, remote, c.nbytes), notif)
        except TransportError as e:
            self._fail(x, e)
            return
        c.phase = phase
        self._poll_chunk(x, c)  # engines that copy inside post are done already: free the slot at once

    def _on_scattered(self, peer: str, m: Scattered) -> None:
        found = self._mine(peer, m.xfer, m.chunk, Phase.WRITING, Phase.WAIT_SCATTERED)
        if found is None:
            return
        x, c = found
        c.scattered = True
        if c.phase is Phase.WAIT_SCATTERED:
            self._chunk_done(x, c)
