"""The D ranks a producer rank serves: their layouts and transport connections, one per D rank's
address (a new process hand-shaking from an address replaces the one before), and how many of a
consumer's ranks read each lease (TP sizes that differ)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from kv_connectors import wire
from kv_connectors.errors import KVConnectorError
from kv_connectors.layout import KVLayout
from kv_connectors.tp import reader_count
from kv_connectors.transports.base import Transport

logger = logging.getLogger(__name__)


class Consumers:
    """Engine thread only (handshakes are queued by the side-channel thread)."""

    def __init__(self, transport: Transport, rank: int, tp_size: int, num_kv_heads: int) -> None:
        self._transport = transport
        self._rank, self._tp_size, self._heads = rank, tp_size, num_kv_heads
        # Agent name -> layout and transport metadata: a new layout object per D process (a D
        # restarted under its engine id hand-shakes with other metadata).
        self.layouts: dict[str, KVLayout] = {}
        self._metadata: dict[str, bytes] = {}
        self._engine: dict[str, str] = {}  # agent -> its engine id
        self.readers: dict[str, int] = {}  # consumer engine -> how many of its ranks read from this rank
        self._at: dict[str, str] = {}  # a D rank's side-channel address -> the agent hand-shaking from it
        self._retiring: set[str] = set()  # agents replaced at their address: forgotten once nothing is in flight

    def layout(self, agent: str) -> KVLayout | None:
        """The layout the agent's process hand-shook with (None: it did not)."""
        return self.layouts.get(agent)

    def readers_of(self, engine: str) -> int:
        """How many of that consumer's ranks read each of our leases."""
        return self.readers.get(engine, 1)

    def connect(self, request: wire.HandshakeRequest) -> None:
        assert request.layout is not None
        try:
            self._transport.connect(request.agent_name, request.agent_metadata)
            if self._metadata.get(request.agent_name) != request.agent_metadata:  # a new D process
                self.layouts[request.agent_name] = request.layout.to_layout()
                self._metadata[request.agent_name] = request.agent_metadata
            self._engine[request.agent_name] = request.engine_id
            self._retiring.discard(request.agent_name)
            if request.address:
                old = self._at.get(request.address)
                self._at[request.address] = request.agent_name
                if old is not None and old != request.agent_name:
                    self._retiring.add(old)  # that process is gone: its port is the new one's
            if request.tp_size != self._tp_size:  # the handshake checked that this can be mapped
                self.readers[request.engine_id] = reader_count(self._heads, self._tp_size, request.tp_size, self._rank)
            else:  # restarted at our TP size under the same engine id
                self.readers.pop(request.engine_id, None)
            logger.info("consumer %s rank %d of %d connected", request.engine_id, request.rank, request.tp_size)
        except KVConnectorError as e:
            logger.error("cannot connect consumer %s: %s", request.engine_id, e)

    def retire(self, busy: Collection[str]) -> None:
        """Forget consumers replaced at their address, once no push of theirs (busy) waits or is in flight."""
        for agent in [a for a in self._retiring if a not in busy]:
            self._retiring.discard(agent)
            self.layouts.pop(agent, None)
            self._metadata.pop(agent, None)
            engine = self._engine.pop(agent, None)
            if engine is not None and engine not in self._engine.values():
                self.readers.pop(engine, None)
            try:
                self._transport.disconnect(agent)
            except KVConnectorError as e:
                logger.debug("could not disconnect consumer %s: %s", agent, e)
            logger.info("consumer %s forgotten: a new process hand-shook from its address", agent)

    @property
    def retiring(self) -> bool:
        return bool(self._retiring)
