"""Responder side of staging: serving a peer's chunks from our pool (gather for its READ, scatter its WRITE)."""

from __future__ import annotations

import collections
import logging

import numpy as np

from kv_connectors.errors import TransferTimeoutError, TransportError
from kv_connectors.transports.base import Op
from kv_connectors.transports.intervals import Ranges, total_bytes
from kv_connectors.transports.staging.copier import Copies
from kv_connectors.transports.staging.messages import (
    Error,
    Free,
    Ready,
    Scatter,
    Scattered,
    Slot,
    Stage,
    Want,
    error_kind,
    unpack_runs,
)
from kv_connectors.transports.staging.outbox import Outbox
from kv_connectors.transports.staging.peers import PeerTable
from kv_connectors.transports.staging.pool import SlotPool
from kv_connectors.transports.staging.xfer import Serve

logger = logging.getLogger(__name__)

_ABORTED_MEMORY = 4096  # (peer, transfer) ids remembered as aborted, to drop their late messages


class Responder:
    """Chunks peers ask us to serve: a STAGE (their READ) waits for a slot, is gathered into it from
    our KV cache and answered READY, and holds the slot until FREE; a WANT (their WRITE) waits for a
    slot, is answered SLOT, and holds it until the SCATTER their write carries has been scattered
    into our KV cache (SCATTERED). Every run a peer names is checked against our registered KV
    memory first. Drops everything it holds for a peer the peer table says is gone.

    We hold at most the pool's peer_cap slots for one peer; its further chunks wait in the queue. A
    peer the table calls suspect keeps what it holds (it may still read a READY slot or write a
    granted one: handing that slot to another peer would give it the suspect's bytes), counted as
    quarantined; its queued chunks are refused (a TransferTimeoutError ERROR it reads if it resumes)."""

    def __init__(self, name: str, *, pool: SlotPool, copies: Copies, outbox: Outbox, peers: PeerTable, kv: Ranges) -> None:
        self._name = name
        self._pool = pool
        self._copies = copies
        self._outbox = outbox
        self._kv = kv
        self._peers = peers
        self._served: dict[tuple[str, int, int], Serve] = {}  # chunks holding a slot, by (peer, xfer, chunk)
        self._aborted: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        peers.subscribe(on_gone=self.drop_peer, on_suspect=self.refuse_queued)

    def busy_peers(self) -> set[str]:
        """Peers we hold a slot for (waiting on their FREE or SCATTER)."""
        return {key[0] for key in self._served}

    def quarantined(self) -> int:
        """Slots held for suspect peers: out of the pool until the peer answers or is gone."""
        suspects = self._peers.suspects()
        return sum(1 for key in self._served if key[0] in suspects)

    def refuse_queued(self, peer: str) -> None:
        """The peer is suspect: its chunks still waiting for a slot fail (their transfers with them)."""
        refused = self._pool.cancel(lambda item: isinstance(item, Serve) and item.peer == peer)
        for xfer in dict.fromkeys(s.xfer for s in refused if isinstance(s, Serve)):
            err = TransferTimeoutError(f"staging {self._name}: {peer} stopped answering; its queued chunk was refused")
            self._outbox.send(peer, Error(xfer, True, error_kind(err), str(err)))
            self._remember_aborted(peer, xfer)
        if refused:
            logger.warning("staging %s: refused %d queued chunks of suspect peer %s", self._name, len(refused), peer)

    def drop_peer(self, peer: str, err: TransportError | None = None) -> None:
        """Free every slot held for the peer and forget its queued chunks."""
        self._drop(peer, None)

    # Message handlers ------------------------------------------------------------------------------
    def on_stage(self, peer: str, m: Stage) -> None:
        if (peer, m.xfer) in self._aborted:
            return
        try:
            addr, length = unpack_runs(m.runs)
            self._kv.check(addr, length, f"runs requested by {peer}", "KV memory")
            nbytes = total_bytes(length)
            if not 0 < nbytes <= self._pool.chunk_bytes:
                raise TransportError(f"chunk of {nbytes} bytes does not fit a {self._pool.chunk_bytes}-byte slot")
        except TransportError as e:
            self._outbox.send(peer, Error(m.xfer, True, 0, f"staging {self._name}: {e}"))
            return
        self._wait_for_slot(Serve(peer, m.xfer, m.chunk, Op.READ, nbytes, m.runs))

    def on_want(self, peer: str, m: Want) -> None:
        if (peer, m.xfer) in self._aborted:
            return
        if not 0 < m.nbytes <= self._pool.chunk_bytes:
            reason = f"staging {self._name}: chunk of {m.nbytes} bytes does not fit a {self._pool.chunk_bytes}-byte slot"
            self._outbox.send(peer, Error(m.xfer, True, 0, reason))
            return
        self._wait_for_slot(Serve(peer, m.xfer, m.chunk, Op.WRITE, m.nbytes))

    def on_free(self, peer: str, m: Free) -> None:
        s = self._served.get((peer, m.xfer, m.chunk))
        if s is not None and s.slot == m.offset:
            self._unserve(s)
            self._pool.grant()

    def on_scatter(self, peer: str, m: Scatter) -> None:
        s = self._served.get((peer, m.xfer, m.chunk))
        if s is None or s.op is not Op.WRITE or s.slot != m.offset:
            logger.debug("staging %s: dropped a stale SCATTER from %s", self._name, peer)
            return
        try:
            addr, length = unpack_runs(m.runs)
            self._kv.check(addr, length, f"runs written by {peer}", "KV memory")
            nbytes = total_bytes(length)
            if nbytes != s.nbytes:
                raise TransportError(f"SCATTER of {nbytes} bytes into a slot granted for {s.nbytes}")
            self._copies.copy(addr, self._slot_pieces(s, length), length)
        except TransportError as e:
            self._unserve(s)
            self._outbox.send(peer, Error(m.xfer, True, error_kind(e), f"staging {self._name}: {e}"))
            return
        self._unserve(s)
        self._outbox.send(peer, Scattered(m.xfer, m.chunk))
        self._pool.grant()

    def on_error(self, peer: str, m: Error) -> None:
        """The peer aborted one of its transfers (an ERROR without to_initiator): drop what we hold for it."""
        self._drop(peer, m.xfer)
        self._remember_aborted(peer, m.xfer)

    def _remember_aborted(self, peer: str, xfer: int) -> None:
        self._aborted[(peer, xfer)] = None
        while len(self._aborted) > _ABORTED_MEMORY:
            self._aborted.popitem(last=False)

    # Slots -----------------------------------------------------------------------------------------
    def _wait_for_slot(self, s: Serve) -> None:
        self._pool.wait(s, False, s.peer, lambda slot: self._start_serving(s, slot))

    def _start_serving(self, s: Serve, slot: int) -> None:
        with self._outbox.unit():
            s.slot = slot
            self._served[(s.peer, s.xfer, s.chunk)] = s
            try:
                if s.op is Op.READ:
                    addr, length = unpack_runs(s.runs)
                    self._copies.copy(self._slot_pieces(s, length), addr, length)
                    self._outbox.send(s.peer, Ready(s.xfer, s.chunk, s.slot))
                else:
                    self._outbox.send(s.peer, Slot(s.xfer, s.chunk, s.slot))
            except TransportError as e:
                self._unserve(s)
                self._outbox.send(s.peer, Error(s.xfer, True, error_kind(e), str(e)))

    def _slot_pieces(self, s: Serve, length: np.ndarray) -> np.ndarray:
        """Addresses of pieces of these lengths packed from the start of the slot s holds."""
        pieces: np.ndarray = np.cumsum(length) - length + self._pool.base + s.slot
        return pieces

    def _unserve(self, s: Serve) -> None:
        if self._served.pop((s.peer, s.xfer, s.chunk), None) is not None:
            self._pool.give(s.slot, False, s.peer)

    def _drop(self, peer: str, xfer: int | None) -> None:
        """Free the slots held for a peer's transfer (every transfer if xfer is None), drop its queue."""
        for s in [s for s in self._served.values() if s.peer == peer and xfer in (None, s.xfer)]:
            self._unserve(s)
        self._pool.cancel(lambda item: isinstance(item, Serve) and item.peer == peer and xfer in (None, item.xfer))
