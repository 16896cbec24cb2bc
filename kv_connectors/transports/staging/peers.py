"""The peers a StagedTransport knows: their pools, when each was last heard, liveness probes, death."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kv_connectors.errors import PeerDisconnectedError, TransportError
from kv_connectors.transports.base import Transport, XferState
from kv_connectors.transports.staging.chunks import one_run
from kv_connectors.transports.staging.messages import StagedInfo
from kv_connectors.transports.staging.xfer import settle

logger = logging.getLogger(__name__)

Listener = Callable[[str, TransportError], None]


@dataclasses.dataclass
class Peer:
    info: StagedInfo
    metadata: bytes
    last_heard: float
    probe: Any = None  # inner handle of the liveness probe in flight
    dead: TransportError | None = None  # PeerDisconnectedError seen: gone until connect() again


class PeerTable:
    """Connected peers, their liveness and the news of their failure.

    Whoever keeps state per peer subscribes: `on_failure` listeners hear every failure talking to a
    peer (`report`), `on_gone` listeners hear that a peer is gone (`mark_dead`, `forget`). A peer we
    wait on (`probe`'s busy names) that has been silent for probe_interval_s is probed (a 1-byte
    inner READ of its pool); a probe that fails is reported, and a PeerDisconnectedError marks the
    peer dead: it stays gone until connect() again (a new handshake, or a restarted peer)."""

    def __init__(self, name: str, inner: Transport, probe_interval_s: float) -> None:
        self._name = name
        self._inner = inner
        self._probe_interval = probe_interval_s
        self._peers: dict[str, Peer] = {}
        self._next_probe_check = 0.0
        self._on_failure: list[Listener] = []
        self._on_gone: list[Listener] = []

    def subscribe(self, on_failure: Listener | None = None, on_gone: Listener | None = None) -> None:
        if on_failure is not None:
            self._on_failure.append(on_failure)
        if on_gone is not None:
            self._on_gone.append(on_gone)

    # Who is there ------------------------------------------------------------------------------
    def get(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def live(self, name: str) -> Peer | None:
        """The peer, if it is connected and not gone."""
        peer = self._peers.get(name)
        return peer if peer is not None and peer.dead is None else None

    def require_live(self, name: str) -> Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise TransportError(f"staging peer {name!r} is not connected (call connect first)")
        if peer.dead is not None:
            raise PeerDisconnectedError(f"staging peer {name} is gone ({peer.dead}); connect it again once it has restarted")
        return peer

    def add(self, name: str, info: StagedInfo, metadata: bytes) -> None:
        self._peers[name] = Peer(info, bytes(metadata), time.monotonic())

    def heard(self, name: str) -> None:
        """The peer just showed it is alive (a message, a finished inner op)."""
        peer = self._peers.get(name)
        if peer is not None:
            peer.last_heard = time.monotonic()

    # Failures ----------------------------------------------------------------------------------
    def report(self, name: str, err: TransportError) -> None:
        """Talking to the peer failed: a PeerDisconnectedError marks it dead; every listener hears it."""
        if isinstance(err, PeerDisconnectedError):
            self.mark_dead(name, err)
        self._tell(self._on_failure, name, err)

    def mark_dead(self, name: str, err: TransportError) -> None:
        """The engine says the peer is gone: stop probing it, send it nothing more, tell the listeners."""
        peer = self._peers.get(name)
        if peer is None or peer.dead is not None:
            return
        peer.dead = err
        logger.warning("staging %s: peer %s is gone: %s", self._name, name, err)
        self._gone(name, peer, err)

    def forget(self, name: str, err: TransportError) -> None:
        """Drop a peer (disconnected, or replaced by a new incarnation); the listeners hear err."""
        peer = self._peers.get(name)
        if peer is None:
            return
        if peer.dead is None:
            peer.dead = err
            self._gone(name, peer, err)
        self._peers.pop(name, None)
        if peer.probe is not None:
            self._inner.release(peer.probe)
            peer.probe = None

    def _gone(self, name: str, peer: Peer, err: TransportError) -> None:
        if peer.probe is not None:
            self._inner.release(peer.probe)
            peer.probe = None
        self._tell(self._on_failure, name, err)
        self._tell(self._on_gone, name, err)

    @staticmethod
    def _tell(listeners: list[Listener], name: str, err: TransportError) -> None:
        for listener in listeners:
            listener(name, err)

    # Liveness ----------------------------------------------------------------------------------
    def poll_probes(self) -> None:
        """Poll the probes in flight: a probe that ended well means the peer is alive."""
        now = time.monotonic()
        for name, peer in list(self._peers.items()):
            if peer.probe is None:
                continue
            ended = settle(self._inner, peer.probe)
            if ended is XferState.IN_PROGRESS:
                continue
            peer.probe = None
            if isinstance(ended, TransportError):
                self._probe_failed(name, ended)
            else:
                peer.last_heard = now

    def probe(self, busy: Callable[[], Iterable[str]], probe_addr: int) -> None:
        """Probe each peer we wait on (busy()) that has been silent for probe_interval_s (into probe_addr)."""
        now = time.monotonic()
        if now < self._next_probe_check:
            return
        self._next_probe_check = now + self._probe_interval / 4
        for name in busy():
            peer = self._peers.get(name)
            if peer is None or peer.probe is not None or now - peer.last_heard < self._probe_interval:
                continue
            try:
                peer.probe = self._inner.post_read(name, one_run(peer.info.pool_base, probe_addr, 1), b"")
            except TransportError as e:
                self._probe_failed(name, e)

    def _probe_failed(self, name: str, err: TransportError) -> None:
        if not isinstance(err, PeerDisconnectedError):  # a dead peer is logged once, by mark_dead
            logger.warning("staging %s: liveness probe of %s failed: %s", self._name, name, err)
        self.report(name, type(err)(f"staging peer {name} failed a liveness probe: {err}"))
        self.heard(name)
