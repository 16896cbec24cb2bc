"""Responder side of staging: serving a peer's chunks from our pool (gather for its READ, scatter its WRITE)."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from kv_connectors.errors import TransportError
from kv_connectors.transports.staging.messages import (
    Error,
    Free,
    Msg,
    Ready,
    Scatter,
    Scattered,
    Slot,
    Stage,
    Want,
    error_kind,
    unpack_runs,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Serve:
    """A peer's chunk we serve: queued for a slot, then holding one until FREE / SCATTER."""

    peer: str
    xfer: int
    chunk: int
    op: str  # "READ" (we gather, the peer reads) or "WRITE" (the peer writes, we scatter)
    nbytes: int
    runs: bytes = b""
    slot: int = -1


class Responder:
    """Mixin of StagedTransport: the handlers and slot use of chunks a peer asks us to serve.

    It keeps no state of its own; the attributes and helpers below are StagedTransport's.
    """

    name: str
    _chunk_bytes: int
    _pool_base: int
    _waiters: collections.deque[Any]
    _served: dict[tuple[str, int, int], Serve]
    _aborted: collections.OrderedDict[tuple[str, int], None]
    _send: Callable[[str, Msg], None]
    _copy: Callable[[np.ndarray, np.ndarray, np.ndarray], None]
    _check_kv: Callable[[np.ndarray, np.ndarray, str], None]
    _take: Callable[..., int]
    _give: Callable[..., None]
    _grant: Callable[[], None]

    def _start_serving(self, s: Serve) -> None:
        s.slot = self._take(own=False)
        self._served[(s.peer, s.xfer, s.chunk)] = s
        try:
            if s.op == "READ":
                addr, length = unpack_runs(s.runs)
                self._copy(self._slot_pieces(s, length), addr, length)
                self._send(s.peer, Ready(s.xfer, s.chunk, s.slot))
            else:
                self._send(s.peer, Slot(s.xfer, s.chunk, s.slot))
        except TransportError as e:
            self._unserve(s)
            self._send(s.peer, Error(s.xfer, True, error_kind(e), str(e)))

    # Message handlers: responder side ------------------------------------------------------------
    def _on_stage(self, peer: str, m: Stage) -> None:
        if (peer, m.xfer) in self._aborted:
            return
        try:
            addr, length = unpack_runs(m.runs)
            self._check_kv(addr, length, f"runs requested by {peer}")
            nbytes = int(length.sum())
            if not 0 < nbytes <= self._chunk_bytes:
                raise TransportError(f"chunk of {nbytes} bytes does not fit a {self._chunk_bytes}-byte slot")
        except TransportError as e:
            self._send(peer, Error(m.xfer, True, 0, f"staging {self.name}: {e}"))
            return
        self._waiters.append(Serve(peer, m.xfer, m.chunk, "READ", nbytes, m.runs))

    def _on_want(self, peer: str, m: Want) -> None:
        if (peer, m.xfer) in self._aborted:
            return
        if not 0 < m.nbytes <= self._chunk_bytes:
            reason = f"staging {self.name}: chunk of {m.nbytes} bytes does not fit a {self._chunk_bytes}-byte slot"
            self._send(peer, Error(m.xfer, True, 0, reason))
            return
        self._waiters.append(Serve(peer, m.xfer, m.chunk, "WRITE", m.nbytes))

    def _on_free(self, peer: str, m: Free) -> None:
        s = self._served.get((peer, m.xfer, m.chunk))
        if s is not None and s.slot == m.offset:
            self._unserve(s)
            self._grant()

    def _on_scatter(self, peer: str, m: Scatter) -> None:
        s = self._served.get((peer, m.xfer, m.chunk))
        if s is None or s.op != "WRITE" or s.slot != m.offset:
            logger.debug("staging %s: dropped a stale SCATTER from %s", self.name, peer)
            return
        try:
            addr, length = unpack_runs(m.runs)
            self._check_kv(addr, length, f"runs written by {peer}")
            if int(length.sum()) != s.nbytes:
                raise TransportError(f"SCATTER of {int(length.sum())} bytes into a slot granted for {s.nbytes}")
            self._copy(addr, self._slot_pieces(s, length), length)
        except TransportError as e:
            self._unserve(s)
            self._send(peer, Error(m.xfer, True, error_kind(e), f"staging {self.name}: {e}"))
            return
        self._unserve(s)
        self._send(peer, Scattered(m.xfer, m.chunk))
        self._grant()

    def _slot_pieces(self, s: Serve, length: np.ndarray) -> np.ndarray:
        """Addresses of pieces of these lengths packed from the start of the slot s holds."""
        return np.cumsum(length) - length + self._pool_base + s.slot

    def _unserve(self, s: Serve) -> None:
        if self._served.pop((s.peer, s.xfer, s.chunk), None) is not None:
            self._give(s.slot, own=False)

    def _drop_served(self, peer: str, xfer: int | None = None) -> None:
        """Free the slots held for a peer's transfer (every transfer if xfer is None), drop its queue."""
        for s in [s for s in self._served.values() if s.peer == peer and xfer in (None, s.xfer)]:
            self._unserve(s)
        self._waiters = collections.deque(
            w for w in self._waiters if not (isinstance(w, Serve) and w.peer == peer and xfer in (None, w.xfer))
        )
