"""Staging messages received: the inner transport's notifications read, ours dispatched to their handlers, the user's kept."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kv_connectors.transports.base import Transport
from kv_connectors.transports.staging.messages import DEC, MSG_MAGIC, User
from kv_connectors.transports.staging.outbox import Outbox
from kv_connectors.transports.staging.peers import PeerTable

logger = logging.getLogger(__name__)

Handler = Callable[[str, Any], None]  # (peer name, message)


class Inbox:
    """Reads the inner transport's notifications: any of them from a live peer says its process
    runs (a suspect peer is live again); a staging batch is decoded (a malformed one dropped) and
    each message handed to the handler for its type as one unit of work (the outbox flushes after
    it); messages from unknown or gone peers are dropped; user messages, plain or escaped, wait for
    `take`."""

    def __init__(self, name: str, inner: Transport, peers: PeerTable, outbox: Outbox, handlers: Mapping[type, Handler]) -> None:
        self._name = name
        self._inner = inner
        self._peers = peers
        self._outbox = outbox
        self._handlers = dict(handlers)  # which handler takes each staging message type
        self._user: list[tuple[str, bytes]] = []

    def read(self) -> None:
        """Drain the inner transport's notifications."""
        for peer_name, msg in self._inner.get_notifs():
            if self._peers.live(peer_name) is not None:
                self._peers.answered(peer_name)  # its process runs (a suspect peer is live again)
            if msg.startswith(MSG_MAGIC):
                self._dispatch(peer_name, msg)
            else:
                self._user.append((peer_name, msg))

    def take(self) -> list[tuple[str, bytes]]:
        """User messages received since the last call."""
        out, self._user = self._user, []
        return out

    def _dispatch(self, peer_name: str, raw: bytes) -> None:
        try:
            msgs = DEC.decode(raw[len(MSG_MAGIC) :])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("staging %s: dropped a malformed message from %s: %s", self._name, peer_name, e)
            return
        for msg in msgs:
            if isinstance(msg, User):
                self._user.append((peer_name, msg.payload))
                continue
            if self._peers.live(peer_name) is None:
                logger.debug("staging %s: dropped %s from unknown or gone peer %s", self._name, type(msg).__name__, peer_name)
                continue
            with self._outbox.unit():
                self._handlers[type(msg)](peer_name, msg)
