"""A worker's parts, built in order once vLLM registers the KV cache: the side-channel server (bound
first: a port in use fails start-up before anything else), the transport with the KV cache (directly
or through a staging pool), the lease words, then D's and P's wings over them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig, Staging
from kv_connectors.consumer.producers import Producers
from kv_connectors.consumer.ranks import Ranks
from kv_connectors.consumer.receiver import Receiver
from kv_connectors.consumer.renewer import Renewer
from kv_connectors.errors import TransportError
from kv_connectors.fence import LeaseWords
from kv_connectors.hugepages import back_with_huge_pages
from kv_connectors.layout import KVLayout
from kv_connectors.producer.sender import Sender
from kv_connectors.transports.base import MemoryKind, Transport
from kv_connectors.transports.staging import StagedTransport
from kv_connectors.transports.staging.direct import FragmentRule

logger = logging.getLogger(__name__)

TransportFactory = Callable[[str], Transport]


class Server(Protocol):
    compat_hash: str
    port: int  # the port it listens on (the one the system picked, where asked for port 0)

    def close(self) -> None: ...


# (bind host, port, compat hash, handler, max message bytes, shared secret) -> a listening server
ServerFactory = Callable[[str, int, str, Callable[[wire.Body], wire.Body], int, bytes | None], Server]


@dataclasses.dataclass(frozen=True)
class Where:
    """Who the worker is: its config, tensor-parallel rank and size, this start's epoch, and its
    engine's data-parallel index (which side-channel port it listens on: config.PortLayout)."""

    cfg: ConnectorConfig
    rank: int
    tp_size: int
    epoch: str
    dp_index: int = 0


@dataclasses.dataclass(frozen=True)
class Parts:
    """A registered worker: every part built, none missing."""

    server: Server
    address: str  # where peers reach this rank's side channel ("host:port")
    transport: Transport
    staging: StagedTransport | None  # the same object as transport, where the KV moves through a pool
    layout: KVLayout
    compat: wire.CompatInfo  # with the kind of transfer both peers must use
    hash: str
    receiver: Receiver
    ranks: Ranks
    renewer: Renewer
    sender: Sender

    def busy(self) -> bool:
        """Something held or under way in any part (else a step may skip the engine's work)."""
        return (
            self.receiver.busy()
            or self.sender.busy()
            or self.renewer.busy()
            or self.ranks.busy()
            or (self.staging is not None and self.staging.busy())
        )

    def close(self) -> None:
        self.server.close()
        self.receiver.close()
        self.sender.close()
        self.transport.close()


def assemble(
    where: Where,
    layout: KVLayout,
    compat: wire.CompatInfo,
    *,
    kind: MemoryKind,
    device_id: int,
    layer_regions: Mapping[str, Sequence[int]] | None,
    make_transport: TransportFactory,
    transport_label: str,
    serve: ServerFactory,
    handler: Callable[[wire.Body], wire.Body],
    client: sidechannel.Client,
    clock: Callable[[], float],
) -> Parts:
    cfg, rank = where.cfg, where.rank
    server = serve(
        cfg.bind_host,
        cfg.rank_port(rank, where.dp_index, where.tp_size),
        compat.hash(),
        handler,
        cfg.side_channel_max_msg_kib * 1024,
        cfg.side_channel_secret or None,
    )
    try:
        transport, staging = _registered_transport(cfg, f"{cfg.engine_id}-rank{rank}", layout, kind, device_id, make_transport)
    except BaseException:
        server.close()
        raise
    # Both peers must move data the same way (same engine; staged or not).
    compat = msgspec.structs.replace(compat, transport=transport_label + ("+staging" if staging is not None else ""))
    compat_hash = server.compat_hash = compat.hash()
    address = sidechannel.address(cfg.side_channel_host, server.port)
    try:
        # With staging "fragmented" the words are registered like the KV: read directly or through the pool.
        pool_only = staging is not None and cfg.staging is not Staging.FRAGMENTED
        words, scratch = _register_words(cfg, transport, layout, kind, staged=pool_only)
        # Fixed once the memory is registered; read here so that the side-channel thread never calls
        # into the engine (NIXL agents are not thread-safe, and a long post on the engine thread would
        # stall every handshake behind the engine's lock).
        local_metadata = transport.local_metadata()
    except BaseException:
        transport.close()
        server.close()
        raise
    producers = Producers(
        cfg,
        rank,
        where.tp_size,
        transport,
        layout,
        compat,
        client=client,
        local_metadata=local_metadata,
        scratch=scratch,
        clock=clock,
        address=address,
    )
    renewer = Renewer(cfg.engine_id, compat_hash, client, cfg.handshake_timeout_s, clock)
    receiver = Receiver(cfg, rank, transport, layout, producers, client=client, clock=clock, scratch=scratch, renewer=renewer)
    ranks = Ranks(
        cfg, rank, where.tp_size, compat.num_kv_heads, layout, receiver=receiver, renewer=renewer, client=client, clock=clock
    )
    identity = wire.HandshakeReply(
        engine_id=cfg.engine_id,
        agent_name=transport.name,
        agent_metadata=local_metadata,
        layout=wire.LayoutMsg.from_layout(layout),
        epoch=where.epoch,
        rank=rank,
        tp_size=where.tp_size,
        lease_words=0 if words is None else words.base,
    )
    # Layer-wise push writes straight from the KV cache: not through a staging pool.
    layers = layer_regions if staging is None and cfg.layerwise else None
    sender = Sender(cfg, transport, layout, compat, layers, identity=identity, clock=clock, words=words)
    logger.info(
        "KV cache registered: %d blocks x %d bytes in %d regions, %s, compat hash %s",
        layout.num_blocks,
        layout.block_bytes,
        len(layout.regions),
        layout.cells or "whole blocks only",
        compat_hash,
    )
    return Parts(server, address, transport, staging, layout, compat, compat_hash, receiver, ranks, renewer, sender)


def _register_words(
    cfg: ConnectorConfig, transport: Transport, layout: KVLayout, kind: MemoryKind, staged: bool
) -> tuple[LeaseWords | None, LeaseWords | None]:
    """Lease words (kv_connectors.fence) beside a host KV cache moved directly: P's, and D's scratch
    they are read into. Not with a staging pool alone (staging "on": only the pool is registered) or
    device memory (the words live in host memory, which one transfer cannot mix with the KV's)."""
    if not cfg.lease_words or staged or kind is not MemoryKind.HOST:
        return None, None
    words = LeaseWords(layout.num_blocks) if cfg.role.produces else None
    scratch = LeaseWords(layout.num_blocks) if cfg.role.consumes else None
    for w in (words, scratch):
        if w is not None:
            transport.register(w.layout, MemoryKind.HOST)
    return words, scratch


def _registered_transport(
    cfg: ConnectorConfig, name: str, layout: KVLayout, kind: MemoryKind, device_id: int, make: TransportFactory
) -> tuple[Transport, StagedTransport | None]:
    """The transport with the KV cache registered: directly, or through a staging pool when asked
    (staging=on) or when device memory cannot be registered (staging=auto); both with staging=fragmented
    (plans of many short runs through the pool, the rest directly)."""
    if cfg.staging is Staging.ON:
        staged = _staged(cfg, name, layout, kind, device_id, make)
        return staged, staged
    if kind is MemoryKind.HOST and cfg.host_huge_pages:  # before the engine registers (and may pin) it
        back_with_huge_pages((r.base, r.span) for r in layout.regions)
    if cfg.staging is Staging.FRAGMENTED:
        rule = FragmentRule(cfg.staging_fragment_runs, cfg.staging_fragment_kib * 1024)
        staged = _staged(cfg, name, layout, kind, device_id, make, rule)
        return staged, staged
    transport = make(name)
    try:
        transport.register(layout, kind, device_id)
        return transport, None
    except TransportError as e:
        transport.close()
        if cfg.staging is not Staging.AUTO or kind is not MemoryKind.DEVICE:
            raise
        logger.warning(
            "device memory cannot be registered with the transport (%s): staging through a %d KiB host pool",
            e,
            cfg.staging_pool_kib,
        )
    staged = _staged(cfg, name, layout, kind, device_id, make)
    return staged, staged


def _staged(
    cfg: ConnectorConfig,
    name: str,
    layout: KVLayout,
    kind: MemoryKind,
    device_id: int,
    make: TransportFactory,
    fragments: FragmentRule | None = None,
) -> StagedTransport:
    inner = make(name)
    try:
        pool, chunk = cfg.staging_pool_kib * 1024, cfg.staging_chunk_kib * 1024
        staged = StagedTransport(inner, pool_bytes=pool, chunk_bytes=chunk, fragments=fragments)
        staged.register(layout, kind, device_id)
    except BaseException:
        inner.close()
        raise
    return staged
