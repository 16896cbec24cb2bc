"""Initiator side of staging: our transfers' chunk pipeline (gather or stage, pool-to-pool move, scatter)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from kv_connectors.errors import PeerDisconnectedError, TransportError
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import Op, Transport, XferState
from kv_connectors.transports.intervals import Ranges
from kv_connectors.transports.staging.chunks import chunk_plan, one_run
from kv_connectors.transports.staging.copier import Copies
from kv_connectors.transports.staging.drains import Drains
from kv_connectors.transports.staging.messages import (
    ENC,
    ERROR_KINDS,
    MSG_MAGIC,
    Error,
    Free,
    Ready,
    Scatter,
    Scattered,
    Slot,
    Stage,
    Want,
    pack_runs,
    user_bytes,
)
from kv_connectors.transports.staging.outbox import Outbox
from kv_connectors.transports.staging.peers import PeerTable
from kv_connectors.transports.staging.pool import SlotPool
from kv_connectors.transports.staging.xfer import Chunk, Phase, StagedXfer, Transfer

logger = logging.getLogger(__name__)


class Initiator:
    """Our own transfers: each plan cut into chunks that take turns for pool slots; per chunk, a
    READ stages the runs at the peer (STAGE), reads its slot (READY) into ours, scatters into our KV
    cache and frees the peer's slot (FREE); a WRITE gathers into our slot, asks for one of the
    peer's (WANT / SLOT), writes it with the runs to scatter (SCATTER) and waits for SCATTERED.

    A failed transfer's inner ops still in flight are polled to their end (at most drain_timeout_s)
    before their slots are reused; the peer hears of the failure (ERROR) only then, so no late write
    of ours lands in a reused slot (drains.py). Fails every transfer with a peer when the peer table
    reports a failure talking to it."""

    def __init__(
        self,
        name: str,
        inner: Transport,
        *,
        pool: SlotPool,
        copies: Copies,
        outbox: Outbox,
        peers: PeerTable,
        kv: Ranges,
        max_runs_per_chunk: int,
        drain_timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._name = name
        self._inner = inner
        self._pool = pool
        self._copies = copies
        self._outbox = outbox
        self._peers = peers
        self._kv = kv
        self._max_runs = max_runs_per_chunk
        self._xfers: dict[int, Transfer] = {}  # our unfinished transfers
        self._drains = Drains(name, inner, pool=pool, outbox=outbox, drain_timeout_s=drain_timeout_s, clock=clock)
        self._next_id = random.getrandbits(56)  # random start: a restarted peer does not reuse ids
        peers.subscribe(on_failure=self.fail_peer)

    def busy_peers(self) -> set[str]:
        """Peers with an unfinished transfer of ours."""
        return {t.peer for t in self._xfers.values()}

    def waiting_peers(self) -> set[str]:
        """Peers we wait on for a chunk under way (its READY, SLOT, SCATTERED, or its inner op), not
        merely queued for one of our slots: the peer owes us nothing until a chunk starts."""
        return {t.peer for t in self._xfers.values() if t.active}

    # Posting and progress ------------------------------------------------------------------------
    def post(self, op: Op, peer_name: str, plan: TransferPlan, notif: bytes) -> StagedXfer:
        """Argument errors raise here; engine and peer errors surface in the handle's error."""
        peer = self._peers.require_live(peer_name)
        self._kv.check(plan.dst if op is Op.READ else plan.src, plan.length, f"local side of {op}", "KV memory")
        chunks = chunk_plan(plan, min(self._pool.chunk_bytes, peer.info.chunk_bytes), min(self._max_runs, peer.info.max_runs))
        self._next_id += 1
        handle = StagedXfer(peer_name, op, plan.num_runs, plan.total_bytes, chunks.num_chunks, id=self._next_id)
        if chunks.num_chunks == 0:
            if notif:
                self._inner.send_notif(peer_name, user_bytes(notif))
            handle.state = XferState.DONE
            return handle
        t = Transfer(handle, chunks, bytes(notif))
        self._xfers[t.id] = t
        self._wait_for_slot(t)
        logger.debug(
            "staged %s %s: %d runs, %d bytes, %d chunks", op, peer_name, plan.num_runs, plan.total_bytes, chunks.num_chunks
        )
        self._pool.grant()
        self._outbox.flush()
        return handle

    def poll(self) -> None:
        """Poll the inner ops of our chunks, and those of failed transfers still draining."""
        for t in list(self._xfers.values()):
            for c in list(t.active.values()):
                if c.inner is not None and t.handle.error is None:
                    with self._outbox.unit():
                        self._poll_chunk(t, c)
        self._drains.poll()

    def abort(self, handle: StagedXfer, err: TransportError) -> None:
        """Fail an unfinished transfer (released by the caller, or the transport closing)."""
        t = self._xfers.get(handle.id)
        if t is not None and t.handle is handle:
            self._fail(t, err)

    def settled(self, handle: StagedXfer) -> bool:
        """No byte of the transfer can reach the destination's KV cache any more: it completed; or
        it failed and is a READ (we scatter into our KV ourselves, and no longer do), or a WRITE
        whose inner ops all ended (the peer scatters only on the SCATTER their notifications carry,
        and drops later ones once our ERROR, sent after the drain, reached it)."""
        if handle.state is XferState.DONE:
            return True
        if handle.error is None:
            return False
        return handle.op is Op.READ or not self._drains.draining(handle)

    @property
    def quarantined_slots(self) -> int:
        return self._drains.quarantined_slots

    def abort_all(self, err: TransportError) -> None:
        for t in list(self._xfers.values()):
            self._fail(t, err)

    def fail_peer(self, peer_name: str, err: TransportError) -> None:
        """Fail every unfinished transfer of ours with that peer."""
        for t in [t for t in self._xfers.values() if t.peer == peer_name]:
            self._fail(t, err)

    # Chunks ----------------------------------------------------------------------------------------
    def _wait_for_slot(self, t: Transfer) -> None:
        self._pool.wait(t, True, t.peer, lambda slot: self._start_chunk(t, slot))

    def _start_chunk(self, t: Transfer, slot: int) -> None:
        with self._outbox.unit():
            k = t.next
            t.next += 1
            if t.next < t.handle.num_chunks:
                self._wait_for_slot(t)  # back of the queue: transfers take turns
            c = Chunk(k, slot, t.chunks.nbytes(k), Phase.WAIT_READY)
            t.active[k] = c
            sl = t.chunks.pieces(k)
            try:
                if t.op is Op.READ:
                    self._outbox.send(t.peer, Stage(t.id, k, pack_runs(t.chunks.src[sl], t.chunks.length[sl])))
                else:
                    self._copies.copy(self._pool.base + slot + t.chunks.slot_off[sl], t.chunks.src[sl], t.chunks.length[sl])
                    c.phase = Phase.WAIT_SLOT
                    self._outbox.send(t.peer, Want(t.id, k, c.nbytes))
            except TransportError as e:
                self._fail(t, e)

    def _poll_chunk(self, t: Transfer, c: Chunk) -> None:
        try:
            state = self._inner.poll(c.inner)
        except TransportError as e:
            if self._inner.settled(c.inner):  # else it may still land in the slot: drained by _fail
                self._inner.release(c.inner)
                c.inner = None
            self._fail(t, e)
            return
        if state is XferState.IN_PROGRESS:
            return
        self._inner.release(c.inner)
        c.inner = None
        self._peers.heard(t.peer)
        try:
            if c.phase is Phase.READING:
                self._scatter_local(t, c)
            else:
                self._pool.give(c.slot, True, t.peer)
                c.slot = None
                c.phase = Phase.WAIT_SCATTERED
                if c.scattered:
                    self._chunk_done(t, c)
        except TransportError as e:
            self._fail(t, e)
        self._pool.grant()  # the freed slot starts the next chunk now: keeps the peer busy

    def _scatter_local(self, t: Transfer, c: Chunk) -> None:
        """READ: the chunk is in our slot; copy it into our KV cache, free both slots."""
        assert c.slot is not None
        sl = t.chunks.pieces(c.index)
        self._copies.copy(t.chunks.dst[sl], self._pool.base + c.slot + t.chunks.slot_off[sl], t.chunks.length[sl])
        self._pool.give(c.slot, True, t.peer)
        c.slot = None
        self._outbox.send(t.peer, Free(t.id, c.index, c.remote_off))
        self._chunk_done(t, c)

    def _chunk_done(self, t: Transfer, c: Chunk) -> None:
        if t.active.pop(c.index, None) is None:
            return  # the transfer failed meanwhile (e.g. while flushing messages)
        h = t.handle
        h.chunks_done += 1
        if h.chunks_done < h.num_chunks:
            return
        if t.notif:  # every chunk is in the destination KV cache: the user's notification follows
            self._outbox.flush(t.peer)
            try:
                self._inner.send_notif(t.peer, user_bytes(t.notif))
            except TransportError as e:
                self._fail(t, e)
                return
        h.state = XferState.DONE
        self._xfers.pop(t.id, None)
        logger.debug("staged %s %s done: %d bytes in %d chunks", h.op, h.peer_name, h.nbytes, h.num_chunks)

    def _post_inner(self, t: Transfer, c: Chunk, remote_off: int, phase: Phase, notif: bytes) -> None:
        """Post the pool-to-pool move of one chunk between our slot and the peer's."""
        assert c.slot is not None
        peer = self._peers.get(t.peer)
        assert peer is not None  # a transfer with a forgotten peer has failed
        if not (0 <= remote_off and remote_off + c.nbytes <= peer.info.pool_bytes):
            self._fail(t, TransportError(f"staging peer {t.peer} offered slot {remote_off} outside its pool"))
            return
        local, remote = self._pool.base + c.slot, peer.info.pool_base + remote_off
        try:
            if phase is Phase.READING:
                c.inner = self._inner.post_read(t.peer, one_run(remote, local, c.nbytes), notif)
            else:
                c.inner = self._inner.post_write(t.peer, one_run(local, remote, c.nbytes), notif)
        except TransportError as e:
            self._fail(t, e)
            return
        c.phase = phase
        self._poll_chunk(t, c)  # engines that copy inside post are done already: free the slot at once

    # Message handlers ------------------------------------------------------------------------------
    def _mine(self, peer: str, xfer: int, chunk: int, *phases: Phase) -> tuple[Transfer, Chunk] | None:
        t = self._xfers.get(xfer)
        c = t.active.get(chunk) if t is not None and t.peer == peer else None
        return (t, c) if t is not None and c is not None and c.phase in phases else None

    def on_ready(self, peer: str, m: Ready) -> None:
        found = self._mine(peer, m.xfer, m.chunk, Phase.WAIT_READY)
        if found is None:
            self._outbox.send(peer, Free(m.xfer, m.chunk, m.offset))  # stale: let the peer free its slot
            return
        t, c = found
        c.remote_off = m.offset
        self._post_inner(t, c, m.offset, Phase.READING, b"")

    def on_slot(self, peer: str, m: Slot) -> None:
        found = self._mine(peer, m.xfer, m.chunk, Phase.WAIT_SLOT)
        if found is None:
            self._outbox.send(peer, Free(m.xfer, m.chunk, m.offset))
            return
        t, c = found
        sl = t.chunks.pieces(c.index)
        scatter = Scatter(t.id, c.index, m.offset, pack_runs(t.chunks.dst[sl], t.chunks.length[sl]))
        c.remote_off = m.offset
        self._post_inner(t, c, m.offset, Phase.WRITING, MSG_MAGIC + ENC.encode([scatter]))

    def on_scattered(self, peer: str, m: Scattered) -> None:
        found = self._mine(peer, m.xfer, m.chunk, Phase.WRITING, Phase.WAIT_SCATTERED)
        if found is None:
            return
        t, c = found
        c.scattered = True
        if c.phase is Phase.WAIT_SCATTERED:
            self._chunk_done(t, c)

    def on_error(self, peer: str, m: Error) -> None:
        """The peer failed serving one of our transfers (an ERROR with to_initiator set)."""
        t = self._xfers.get(m.xfer)
        if t is not None and t.peer == peer:
            cls = ERROR_KINDS[m.kind] if 0 <= m.kind < len(ERROR_KINDS) else TransportError
            self._fail(t, cls(f"staged {t.op} with {peer}: the peer reported: {m.reason}"))

    # Failures --------------------------------------------------------------------------------------
    def _fail(self, t: Transfer, err: TransportError) -> None:
        """Fail a transfer: free its idle slots now, drain its inner ops, then tell the peer."""
        h = t.handle
        if h.state is XferState.DONE or h.error is not None:
            return
        h.error = err
        self._xfers.pop(t.id, None)
        self._pool.cancel(lambda item: item is t)
        logger.debug("staged %s with %s failed: %s", h.op, h.peer_name, err)
        if isinstance(err, PeerDisconnectedError):
            self._peers.mark_dead(t.peer, err)  # fails the peer's other transfers too
        self._drains.start(t)  # the peer hears of it once no write of ours can land in its slots
