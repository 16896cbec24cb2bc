"""The peers a StagedTransport knows: their pools, when each was last heard, liveness probes, suspicion, death."""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable
from typing import Any

from kv_connectors.errors import PeerDisconnectedError, TransportError
from kv_connectors.transports.base import Transport, XferState
from kv_connectors.transports.staging.chunks import one_run
from kv_connectors.transports.staging.messages import StagedInfo
from kv_connectors.transports.staging.xfer import settle

logger = logging.getLogger(__name__)

Listener = Callable[[str, TransportError], None]
SuspectListener = Callable[[str], None]

# A probe is a 1-byte read: on a live link it ends in micro- to milliseconds. One that has neither
# completed nor failed after this many probe intervals means a stopped process (over TCP its memory
# no longer answers) or a dead link the engine has not reported yet.
PROBE_DEADLINE_INTERVALS = 4
# Over cma or RDMA a stopped process's memory still answers a probe, so silence is the other sign:
# a peer that owes us a message (a chunk of ours under way, a slot we hold for it) and sends none,
# and finishes no inner op of ours, for this many intervals. Longer than a busy peer's engine step
# (staging progresses only when its engine steps); a peer wrongly suspected loses nothing it holds.
SILENT_INTERVALS = 10


class Standing(enum.Enum):
    LIVE = "live"
    SUSPECT = "suspect"  # past its probe deadline or silent: no new slot for it, what it holds is quarantined
    GONE = "gone"  # its connection is dead (PeerDisconnectedError), or disconnected / replaced


@dataclasses.dataclass
class Peer:
    info: StagedInfo
    metadata: bytes
    last_heard: float  # anything that shows it alive, a successful probe too: when to probe next
    last_message: float  # a message from it or a finished inner op with it: what silence counts from
    probe: Any = None  # inner handle of the liveness probe in flight
    probe_posted: float = 0.0
    standing: Standing = Standing.LIVE
    dead: TransportError | None = None  # why it is GONE: gone until connect() again


class PeerTable:
    """Connected peers, their liveness and the news of their failure.

    Whoever keeps state per peer subscribes: `on_failure` listeners hear every failure talking to a
    peer (`report`), `on_gone` listeners hear that a peer is gone (`mark_dead`, `forget`),
    `on_suspect` listeners that a peer stopped answering. A peer we hold anything for (`probe`'s busy
    names) that has been silent for probe_interval_s is probed (a 1-byte inner READ of its pool); a
    probe that fails is reported, and a PeerDisconnectedError marks the peer dead: it stays gone
    until connect() again (a new handshake, or a restarted peer). A probe that has neither ended by
    its deadline, or a peer we wait on that has been silent for SILENT_INTERVALS, makes the peer
    SUSPECT: it is not gone (it may resume and read or write what it was granted), so nothing it
    holds is freed, but nothing new is granted to it either; a message from it (`answered`) makes it
    LIVE again. Its probes go on, so that a death is still noticed."""

    def __init__(
        self,
        name: str,
        inner: Transport,
        probe_interval_s: float,
        clock: Callable[[], float],
        *,
        probe_deadline_s: float | None = None,
        silence_s: float | None = None,
    ) -> None:
        self._name = name
        self._inner = inner
        self._clock = clock
        self._probe_interval = probe_interval_s
        self._probe_deadline = probe_interval_s * PROBE_DEADLINE_INTERVALS if probe_deadline_s is None else probe_deadline_s
        self._silence = probe_interval_s * SILENT_INTERVALS if silence_s is None else silence_s
        self._peers: dict[str, Peer] = {}
        self._next_probe_check = 0.0
        self._waiting_since: dict[str, float] = {}  # peers we wait on: since when (silence counts from then)
        self._looked = clock()  # our last look (poll_probes): time we did not look is nobody's silence
        self._resumed = self._looked
        self._on_failure: list[Listener] = []
        self._on_gone: list[Listener] = []
        self._on_suspect: list[SuspectListener] = []

    def subscribe(
        self, on_failure: Listener | None = None, on_gone: Listener | None = None, on_suspect: SuspectListener | None = None
    ) -> None:
        if on_failure is not None:
            self._on_failure.append(on_failure)
        if on_gone is not None:
            self._on_gone.append(on_gone)
        if on_suspect is not None:
            self._on_suspect.append(on_suspect)

    # Who is there ------------------------------------------------------------------------------
    def get(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def live(self, name: str) -> Peer | None:
        """The peer, if it is connected and not gone (a suspect peer is not gone)."""
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
        now = self._clock()
        self._peers[name] = Peer(info, bytes(metadata), now, now)

    def heard(self, name: str) -> None:
        """An inner op with the peer finished: not silent (but over cma or RDMA a stopped process's
        memory still serves one, so it does not end a suspicion)."""
        peer = self._peers.get(name)
        if peer is not None:
            peer.last_heard = peer.last_message = self._clock()

    def answered(self, name: str) -> None:
        """A message from the peer arrived: its process runs. A suspect peer is live again."""
        peer = self._peers.get(name)
        if peer is None:
            return
        peer.last_heard = peer.last_message = peer.probe_posted = self._clock()  # a probe in flight: its deadline anew
        if peer.standing is Standing.SUSPECT:
            peer.standing = Standing.LIVE
            logger.warning("staging %s: suspect peer %s answers again; serving it again", self._name, name)

    def suspect(self, name: str) -> bool:
        peer = self._peers.get(name)
        return peer is not None and peer.standing is Standing.SUSPECT

    def suspects(self) -> set[str]:
        return {name for name, peer in self._peers.items() if peer.standing is Standing.SUSPECT}

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
        logger.warning("staging %s: peer %s is gone: %s", self._name, name, err)
        self._gone(name, peer, err)

    def forget(self, name: str, err: TransportError) -> None:
        """Drop a peer (disconnected, or replaced by a new incarnation); the listeners hear err."""
        peer = self._peers.get(name)
        if peer is None:
            return
        if peer.dead is None:
            self._gone(name, peer, err)
        self._peers.pop(name, None)
        self._waiting_since.pop(name, None)

    def _gone(self, name: str, peer: Peer, err: TransportError) -> None:
        peer.dead, peer.standing = err, Standing.GONE
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
        """Poll the probes in flight: one that ended well means the peer's memory answers; one
        past its deadline makes the peer suspect (and is kept: if it fails later, the peer is gone)."""
        now = self._clock()
        if now - self._looked > self._probe_interval:  # we did not look for a while: blame nobody for it
            self._resumed = now
        self._looked = now
        for name, peer in list(self._peers.items()):
            if peer.probe is None:
                continue
            ended = settle(self._inner, peer.probe)
            if ended is XferState.IN_PROGRESS:
                if now - max(peer.probe_posted, self._resumed) > self._probe_deadline:
                    self._make_suspect(name, peer, f"its liveness probe has not ended in {self._probe_deadline:.1f} s")
                continue
            peer.probe = None
            if isinstance(ended, TransportError):
                self._probe_failed(name, ended)
            else:
                peer.last_heard = now

    def probe(self, busy: Callable[[], Iterable[str]], waiting: Callable[[], Iterable[str]], probe_addr: int) -> None:
        """Probe each peer we hold anything for (busy()) that has been silent for probe_interval_s
        (into probe_addr); a peer we wait on (waiting()) silent for silence_s becomes suspect."""
        now = self._clock()
        if now < self._next_probe_check:
            return
        self._next_probe_check = now + self._probe_interval / 4
        owing = set(waiting())
        self._waiting_since = {name: self._waiting_since.get(name, now) for name in owing}
        for name in owing:
            peer = self._peers.get(name)
            if peer is not None and now - max(peer.last_message, self._waiting_since[name], self._resumed) > self._silence:
                self._make_suspect(name, peer, f"it has sent nothing for {self._silence:.1f} s")
        for name in busy():
            peer = self._peers.get(name)
            if peer is None or peer.dead is not None or peer.probe is not None or now - peer.last_heard < self._probe_interval:
                continue
            try:
                peer.probe = self._inner.post_read(name, one_run(peer.info.pool_base, probe_addr, 1), b"")
                peer.probe_posted = now
            except TransportError as e:
                self._probe_failed(name, e)

    def _make_suspect(self, name: str, peer: Peer, why: str) -> None:
        if peer.standing is not Standing.LIVE:
            return
        peer.standing = Standing.SUSPECT
        logger.warning(
            "staging %s: peer %s is suspect (%s): nothing new is granted to it, what it holds stays out of the pool "
            "until it answers or is gone",
            self._name,
            name,
            why,
        )
        for listener in self._on_suspect:
            listener(name)

    def _probe_failed(self, name: str, err: TransportError) -> None:
        if not isinstance(err, PeerDisconnectedError):  # a dead peer is logged once, by mark_dead
            logger.warning("staging %s: liveness probe of %s failed: %s", self._name, name, err)
        self.report(name, type(err)(f"staging peer {name} failed a liveness probe: {err}"))
        peer = self._peers.get(name)
        if peer is not None:
            peer.last_heard = self._clock()  # next probe in an interval
