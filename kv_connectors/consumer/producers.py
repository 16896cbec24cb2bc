"""D's directory of producers: one handshake per producer rank's address, its answer checked and connected."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import KVConnectorError
from kv_connectors.fence import WORD_BYTES, LeaseWords, words_layout
from kv_connectors.layout import KVLayout
from kv_connectors.specs import ProducerAddress
from kv_connectors.transports.base import Transport

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Producer:
    """A producer rank: known once its handshake answered."""

    future: concurrent.futures.Future[wire.Body] | None
    agent_name: str = ""
    layout: KVLayout | None = None
    error: str | None = None
    epoch: str = ""  # the producer process the cached handshake came from
    words: KVLayout | None = None  # its lease words (kv_connectors.fence), where it has them and we read them
    # The handshake's timings (the receiver's clock): asked, answered (the client's thread), taken
    # up by the engine thread, connected (after the transport's connect).
    asked_at: float = 0.0
    answered_at: float = 0.0
    taken_at: float = 0.0
    connected_at: float = 0.0

    def waits(self) -> dict[str, float]:
        """The handshake's parts in seconds: the round trip, the wait for the engine thread, the connect."""
        return {
            "reply": max(0.0, self.answered_at - self.asked_at),
            "pickup": max(0.0, self.taken_at - self.answered_at),
            "connect": max(0.0, self.connected_at - self.taken_at),
        }

    @property
    def ready(self) -> bool:
        return self.layout is not None and self.error is None


class Producers:
    """Handshakes (off the engine thread, through the side-channel client) and their answers,
    connected on the engine thread. Transport calls happen on the caller's thread."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        tp_size: int,
        transport: Transport,
        layout: KVLayout,
        compat: wire.CompatInfo,
        *,
        client: sidechannel.Client,
        local_metadata: bytes,
        scratch: LeaseWords | None,
        clock: Callable[[], float] = time.monotonic,
        address: str = "",
    ) -> None:
        self._cfg = cfg
        self._clock = clock
        self._rank, self._tp_size = rank, tp_size
        self._transport = transport
        self._layout = layout
        self._compat = compat
        self.hash = compat.hash()
        self._client = client
        self._local_metadata = local_metadata
        self._scratch = scratch
        self._address = address  # ours, told to producers (a new agent from it replaces the old one)
        self._peers: dict[ProducerAddress, Producer] = {}
        self._expected: dict[ProducerAddress, tuple[int, int]] = {}  # the (rank, TP size) a producer must answer as

    def submit(self, key: ProducerAddress, body: wire.Body) -> concurrent.futures.Future[wire.Body]:
        """One side-channel request to the producer at key (off this thread, with its own deadline)."""
        _engine, host, port = key
        return self._client.submit(host, port, body, self.hash, self._cfg.handshake_timeout_s)

    def get(self, key: ProducerAddress) -> Producer:
        return self._peers[key]

    def find(self, key: ProducerAddress) -> Producer | None:
        return self._peers.get(key)

    def ensure(self, key: ProducerAddress, remote_rank: int, remote_tp_size: int) -> None:
        """Hand-shake with the producer at key unless a good handshake is cached (P connects back
        to us: it writes into our blocks (push) and a staged transport answers our reads)."""
        self._expected[key] = (remote_rank, remote_tp_size)
        peer = self._peers.get(key)
        if peer is not None and peer.error is None:
            return
        request = wire.HandshakeRequest(
            self._cfg.engine_id,
            self._rank,
            self._compat,
            agent_name=self._transport.name,
            agent_metadata=self._local_metadata,
            layout=wire.LayoutMsg.from_layout(self._layout),
            tp_size=self._tp_size,
            address=self._address,
        )
        peer = Producer(None, asked_at=self._clock())
        future = self.submit(key, request)

        def answered(_: concurrent.futures.Future[wire.Body]) -> None:  # the client's thread
            peer.answered_at = self._clock()

        future.add_done_callback(answered)
        peer.future = future
        self._peers[key] = peer

    def mark_failed(self, key: ProducerAddress, why: str) -> None:
        """The next request hand-shakes again (e.g. the producer restarted)."""
        peer = self._peers.get(key)
        if peer is not None:
            peer.error = why

    def awaiting(self) -> bool:
        """A handshake's answer is on its way."""
        return any(peer.future is not None for peer in self._peers.values())

    def resolve(self) -> None:
        """Take the handshakes' answers that arrived: check them and connect the transport."""
        for key, peer in self._peers.items():
            if peer.future is None or not peer.future.done():
                continue
            future, peer.future = peer.future, None
            peer.taken_at = self._clock()
            peer.answered_at = peer.answered_at or peer.taken_at
            try:
                reply = future.result()
                if not isinstance(reply, wire.HandshakeReply) or (key.engine_id and reply.engine_id != key.engine_id):
                    raise KVConnectorError(
                        f"side channel {key.host}:{key.port} answered for engine {getattr(reply, 'engine_id', '?')}, "
                        f"expected {key.engine_id}"
                    )
                expected = self._expected.get(key, (self._rank, self._tp_size))
                if (reply.rank, reply.tp_size) != expected:
                    raise KVConnectorError(
                        f"side channel {key.host}:{key.port} is rank {reply.rank} of tensor_parallel_size {reply.tp_size}; "
                        f"this decode rank {self._rank} of {self._tp_size} expected the prefill's rank {expected[0]} "
                        f"of {expected[1]} there"
                    )
                self._transport.connect(reply.agent_name, reply.agent_metadata)
                peer.agent_name, peer.layout, peer.epoch = reply.agent_name, reply.layout.to_layout(), reply.epoch
                peer.words = self._peer_words(reply, peer.layout)
                peer.connected_at = self._clock()
                logger.info(
                    "connected to producer %s at %s:%d (%s)",
                    key.engine_id,
                    key.host,
                    key.port,
                    " ".join(f"{part}_ms={s * 1e3:.1f}" for part, s in peer.waits().items()),
                )
                for other_key, other in self._peers.items():  # another process answered there before: gone
                    if other_key.where == key.where and other is not peer and other.agent_name != reply.agent_name:
                        other.error = other.error or f"replaced by {reply.agent_name} at {key.host}:{key.port}"
            except Exception as e:  # boundary: a failed handshake fails requests, never the step
                peer.error = str(e)
                logger.error("handshake with %s at %s:%d failed: %s", key.engine_id, key.host, key.port, e)

    def _peer_words(self, reply: wire.HandshakeReply, layout: KVLayout) -> KVLayout | None:
        """The producer's lease words as a layout, if it has them, we read them, and the address
        it gave can be planned (a peer's bytes: a bad one costs it the one-sided fence, nothing else)."""
        base = reply.lease_words
        if self._scratch is None or not base:
            return None
        if not 0 < base < wire.MAX_ADDRESS - layout.num_blocks * WORD_BYTES:
            logger.warning("producer %s gave lease words at %#x: ignored, its reads are claimed", reply.engine_id, base)
            return None
        return words_layout(base, layout.num_blocks)

    def prune(self, named: Callable[[ProducerAddress], bool]) -> None:
        """Forget producers that failed and that no task names (addresses come from requests: a
        client naming many dead ones would otherwise keep an entry and a thread for each)."""
        for key in [key for key, peer in self._peers.items() if peer.error is not None and not named(key)]:
            gone = self._peers.pop(key)
            self._expected.pop(key, None)
            if not any(k.where == key.where for k in self._peers):  # the address's lane serves nobody else
                self._client.forget(key.host, key.port)
            if gone.agent_name and all(p.agent_name != gone.agent_name for p in self._peers.values()):
                try:
                    self._transport.disconnect(gone.agent_name)
                except KVConnectorError as e:
                    logger.debug("could not disconnect producer %s: %s", gone.agent_name, e)

    def close(self) -> None:
        self._client.close()
