"""Staging messages queued per peer and sent as one notification (a batch) per peer."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from kv_connectors.errors import TransportError
from kv_connectors.transports.base import Transport
from kv_connectors.transports.staging.copier import Copies
from kv_connectors.transports.staging.messages import ENC, MSG_MAGIC, Msg
from kv_connectors.transports.staging.peers import PeerTable

logger = logging.getLogger(__name__)

BATCH_BYTES = 32 * 1024  # a peer's queued messages go out once they reach this size (engines cap notifs)


class Outbox:
    """Per-peer queues of staging messages. A queue goes out as one inner notification on `flush`,
    or at once when it reaches BATCH_BYTES; a failed send is reported to the peer table (which fails
    that peer's transfers). Messages to a peer that is gone are dropped (its transfers failed already)."""

    def __init__(self, name: str, inner: Transport, peers: PeerTable, copies: Copies) -> None:
        self._name = name
        self._inner = inner
        self._peers = peers
        self._copies = copies
        self._queues: dict[str, list[Msg]] = {}
        self._bytes: dict[str, int] = {}

    def send(self, peer: str, msg: Msg) -> None:
        """Queue a message for the peer."""
        if self._peers.live(peer) is None:
            return
        self._queues.setdefault(peer, []).append(msg)
        self._bytes[peer] = self._bytes.get(peer, 0) + 32 + len(getattr(msg, "runs", b""))
        if self._bytes[peer] >= BATCH_BYTES:
            self.flush(peer)

    def flush(self, only: str | None = None) -> None:
        """Send the queued messages (one notification per peer, or only that peer's)."""
        for peer in [only] if only is not None else list(self._queues):
            msgs = self._queues.pop(peer, None)
            self._bytes.pop(peer, None)
            if not msgs:
                continue
            try:
                self._inner.send_notif(peer, MSG_MAGIC + ENC.encode(msgs))
            except TransportError as e:
                logger.debug("staging %s: could not send %d messages to %s: %s", self._name, len(msgs), peer, e)
                self._peers.report(peer, e)

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        """A unit of work (a message handled, a chunk polled or started). If it copied bytes (a
        gather or scatter), what it queued goes out when it ends rather than at the end of
        progress(): otherwise a peer waiting on that READY, FREE or STAGE also waits for every later
        chunk's copy in the same batch (a pipeline bubble: D sat idle ~28% of a 256 MiB staged
        pull). Units that only queue messages still go out in one batch."""
        copied = self._copies.bytes
        yield
        if self._copies.bytes != copied:
            self.flush()
