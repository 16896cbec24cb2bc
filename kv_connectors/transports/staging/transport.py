"""CPU staging: a Transport wrapper that moves KV blocks through a bounded host pool (no GPUDirect needed).

Slots are granted first come, first served; a transfer waiting for a slot rejoins the back of
the queue after each chunk, so concurrent transfers and peers interleave. Our own transfers
hold at most slots - 1 slots: one is always left for serving peers, so two transports that
stage towards each other cannot deadlock (with 2 slots a transfer moves one chunk at a time).

Peers: we hold at most peer_slots (default: half the pool) slots serving one peer; its further
chunks wait. A peer we wait on is probed (1-byte inner READ of its pool) every
probe_interval_s: a dead peer fails its transfers with the inner transport's error
(PeerDisconnectedError), the slots we held for it are freed, and it stays gone (posts raise
PeerDisconnectedError) until connect() brings new metadata (a restarted peer). A probe that
has not ended after 4 intervals, or a peer that owes us a message and is silent for 10 (over
cma or RDMA a stopped process's memory still answers probes), makes the peer suspect: it gets
no new slot (our own transfers with it one chunk at a time), its queued chunks are refused
(TransferTimeoutError), it no longer makes busy() true, and the slots it holds are
quarantined, handed to nobody, since it may still read or write them: freed once it is
confirmed gone (PeerDisconnectedError, a new incarnation, disconnect()), served on once a
message from it arrives (pool_stats: quarantined_slots, suspect_peers). Inner ops still in
flight when a transfer fails are polled to their end (at most drain_timeout_s) before their
slots are reused; the peer hears of the failure (ERROR) only then, so no late write of ours
lands in a reused slot.

The work is done by objects this class wires together: SlotPool (pool.py: the pool, its slots
and their queue), Copies (copier.py), PeerTable (peers.py: peers, probes, death), Outbox
(outbox.py: batched messages), Inbox (inbox.py: messages received, dispatched by type),
Initiator (initiator.py: our transfers; drains.py: its failed ones' inner ops) and Responder
(responder.py: serving peers' chunks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kv_connectors.errors import ConfigError, PeerDisconnectedError, TransportError
from kv_connectors.layout import KVLayout
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import MemoryKind, Op, Transport, XferState
from kv_connectors.transports.intervals import Ranges
from kv_connectors.transports.staging.copier import Copier, Copies
from kv_connectors.transports.staging.direct import DirectXfer, FragmentRule
from kv_connectors.transports.staging.inbox import Handler, Inbox
from kv_connectors.transports.staging.initiator import Initiator
from kv_connectors.transports.staging.messages import (
    MD_MAGIC,
    Error,
    Free,
    Ready,
    Scatter,
    Scattered,
    Slot,
    Stage,
    StagedInfo,
    Want,
    user_bytes,
)
from kv_connectors.transports.staging.outbox import Outbox
from kv_connectors.transports.staging.peers import PeerTable
from kv_connectors.transports.staging.pool import SlotPool
from kv_connectors.transports.staging.responder import Responder
from kv_connectors.transports.staging.xfer import StagedXfer

logger = logging.getLogger(__name__)


class StagedTransport:
    """The Transport Protocol around any inner Transport, through a bounded host pool.

    Only the pool (and a 64-byte probe word) is registered with the inner transport; KV blocks
    are gathered into pool slots of chunk_bytes, moved pool to pool, and scattered into the
    destination KV cache, chunk by chunk, several chunks in flight. Both peers must wrap their
    transport and connect() to each other (the responder answers over notifications). Everything
    progresses inside poll() / get_notifs() / progress(); nothing blocks and no thread is started.

    Staging messages ride the inner transport's notifications, batched per peer and per call. Peers
    (slots per peer, probes, suspects, quarantine, drains) and the objects doing the work: see the
    module's docstring. With a FragmentRule (`fragments`), the KV is registered with the inner
    transport too, and a plan the rule does not stage moves directly when the peer did the same
    (direct.py: many short runs go through the pool, the rest directly).
    """

    def __init__(
        self,
        inner: Transport,
        *,
        pool_bytes: int,
        chunk_bytes: int,
        copier: Copier | None = None,
        max_runs_per_chunk: int = 1024,
        probe_interval_s: float = 1.0,
        drain_timeout_s: float = 30.0,
        peer_slots: int | None = None,
        clock: Callable[[], float] | None = None,
        fragments: FragmentRule | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if pool_bytes < 2 * chunk_bytes:
            raise ConfigError(
                f"pool_bytes ({pool_bytes}) must hold at least 2 slots of chunk_bytes "
                f"({chunk_bytes}) so that chunks can be pipelined"
            )
        if max_runs_per_chunk < 1:
            raise ConfigError(f"max_runs_per_chunk must be >= 1, got {max_runs_per_chunk}")
        if probe_interval_s <= 0 or drain_timeout_s <= 0:
            raise ConfigError("probe_interval_s and drain_timeout_s must be > 0 seconds")
        name = inner.name
        self._inner = inner
        self._fragments = fragments  # set: the KV is registered with inner too; plans it does not stage move directly
        self._direct: dict[int, DirectXfer] = {}  # direct transfers not yet released
        self.posts = {"direct": 0, "staged": 0}
        self._max_runs = max_runs_per_chunk
        self._kv = Ranges()  # every registered KV region: the memory transfers may touch
        clock = clock or time.monotonic
        self._peers = PeerTable(name, inner, probe_interval_s, clock)
        self._pool = SlotPool(
            name, inner, pool_bytes, chunk_bytes, peer_cap=peer_slots, granting=lambda peer: not self._peers.suspect(peer)
        )
        self._copies = Copies(name, copier)
        self._outbox = Outbox(name, inner, self._peers, self._copies)
        self._initiator = Initiator(
            name,
            inner,
            pool=self._pool,
            copies=self._copies,
            outbox=self._outbox,
            peers=self._peers,
            kv=self._kv,
            max_runs_per_chunk=max_runs_per_chunk,
            drain_timeout_s=drain_timeout_s,
            clock=clock,
        )
        self._responder = Responder(name, pool=self._pool, copies=self._copies, outbox=self._outbox, peers=self._peers, kv=self._kv)
        handlers: dict[type, Handler] = {
            Stage: self._responder.on_stage,
            Ready: self._initiator.on_ready,
            Free: self._responder.on_free,
            Want: self._responder.on_want,
            Slot: self._initiator.on_slot,
            Scatter: self._responder.on_scatter,
            Scattered: self._initiator.on_scattered,
            Error: self._on_error,
        }
        self._inbox = Inbox(name, inner, self._peers, self._outbox, handlers)
        self._closed = False

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def pool(self) -> Any:
        """The pool tensor (torch uint8, pool_bytes long), None before register()."""
        return self._pool.tensor

    # Protocol: memory and peers ------------------------------------------------------------------
    def register(self, layout: KVLayout, kind: MemoryKind = MemoryKind.HOST, device_id: int = 0) -> None:
        """Allocate the pool and register it (only it) with the inner transport on the first call;
        remember the layout's regions as the KV memory transfers may touch."""
        self._require_open()
        if not self._pool.allocated:
            self._copies.choose(kind, device_id)
            self._pool.allocate(kind, device_id)
        elif (kind, device_id) != (self._pool.kind, self._pool.device_id):
            raise TransportError(
                f"staging {self.name}: cannot mix {kind.value}:{device_id} KV memory with "
                f"{self._pool.kind.value}:{self._pool.device_id}"
            )
        self._kv.add((r.base, r.base + r.span) for r in layout.regions)
        if self._fragments is not None:
            self._inner.register(layout, kind, device_id)

    def local_metadata(self) -> bytes:
        """The inner transport's metadata plus where our pool is."""
        self._require_pool()
        pool = self._pool
        info = StagedInfo(
            self._inner.local_metadata(), pool.base, pool.pool_bytes, pool.chunk_bytes, self._max_runs, self._fragments is not None
        )
        return MD_MAGIC + msgspec.msgpack.encode(info)

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Connect the inner transport; a new incarnation of a known peer fails its old transfers, and a
        peer given up for gone (a cut link, a transient engine error) is taken back on a new handshake."""
        self._require_open()
        if not peer_metadata.startswith(MD_MAGIC):
            raise TransportError(f"peer {peer_name} metadata is not from a StagedTransport (both sides must stage)")
        try:
            info = msgspec.msgpack.decode(peer_metadata[len(MD_MAGIC) :], type=StagedInfo)
        except msgspec.DecodeError as e:
            raise TransportError(f"malformed staging metadata from {peer_name}: {e}") from e
        old = self._peers.get(peer_name)
        if old is not None and old.metadata == peer_metadata and old.dead is None:
            return
        if old is not None:  # a new incarnation, or the same one again after it was given up for gone
            self._peers.forget(peer_name, PeerDisconnectedError(f"staging peer {peer_name} was replaced (reconnected)"))
        self._inner.connect(peer_name, info.inner)
        self._peers.add(peer_name, info, peer_metadata)

    def disconnect(self, peer_name: str) -> None:
        """Forget a peer: its transfers fail, the slots we hold for it are freed."""
        self._require_open()
        self._peers.forget(peer_name, PeerDisconnectedError(f"staging peer {peer_name} disconnected"))
        self._inner.disconnect(peer_name)

    # Protocol: transfers ---------------------------------------------------------------------------
    def post_read(self, peer_name: str, plan: TransferPlan, notif: bytes) -> StagedXfer | DirectXfer:
        """Pull plan.src (peer KV) into plan.dst (ours) chunk by chunk; notif reaches the peer after all."""
        return self._post(Op.READ, peer_name, plan, notif)

    def post_write(self, peer_name: str, plan: TransferPlan, notif: bytes) -> StagedXfer | DirectXfer:
        """Push plan.src (ours) into plan.dst (peer KV) chunk by chunk; notif reaches the peer after all."""
        return self._post(Op.WRITE, peer_name, plan, notif)

    def _post(self, op: Op, peer_name: str, plan: TransferPlan, notif: bytes) -> StagedXfer | DirectXfer:
        """Through the pool, or, where both sides registered their KV with the inner transport and
        the fragment rule does not stage the plan, directly (direct.py)."""
        self._require_pool()
        peer = self._peers.require_live(peer_name)
        if self._fragments is None or not peer.info.kv_direct or self._fragments.staged(plan):
            self.posts["staged"] += 1
            return self._initiator.post(op, peer_name, plan, notif)
        self._kv.check(plan.dst if op is Op.READ else plan.src, plan.length, f"local side of {op}", "KV memory")
        post = self._inner.post_read if op is Op.READ else self._inner.post_write
        handle = DirectXfer(peer_name, op, plan.num_runs, plan.total_bytes, post(peer_name, plan, user_bytes(notif)))
        self._direct[id(handle)] = handle
        self.posts["direct"] += 1
        return handle

    def poll(self, handle: StagedXfer | DirectXfer) -> XferState:
        """Advance all staging work, then DONE or IN_PROGRESS; raises the transfer's typed error."""
        self.progress()  # also for a finished handle: peers may be waiting on us
        if isinstance(handle, DirectXfer):
            return self._inner.poll(handle.inner)
        if handle.error is not None:
            raise handle.error
        return handle.state

    def abort(self, handle: StagedXfer | DirectXfer) -> None:
        """Fail an unfinished transfer now: no further chunk starts or is scattered; its inner ops
        in flight drain (their slots stay out of the pool until they ended). Never raises."""
        if isinstance(handle, DirectXfer):
            self._inner.abort(handle.inner)
            return
        self.release(handle)

    def settled(self, handle: StagedXfer | DirectXfer) -> bool:
        """Whether no byte of the transfer can reach the destination's KV any more (Initiator.settled)."""
        try:
            self.progress()
        except TransportError:
            pass
        if isinstance(handle, DirectXfer):
            return self._inner.settled(handle.inner)
        return self._initiator.settled(handle)

    def release(self, handle: StagedXfer | DirectXfer) -> None:
        """Forget a handle; an unfinished transfer is failed (as abort). Never raises."""
        if isinstance(handle, DirectXfer):
            self._direct.pop(id(handle), None)
            self._inner.release(handle.inner)
            return
        try:
            if handle.state is not XferState.DONE and handle.error is None:
                err = TransportError(f"staged {handle.op} with {handle.peer_name}: released before completion")
                self._initiator.abort(handle, err)
                self._outbox.flush()
        except Exception as e:  # release must never raise (error paths call it)
            logger.warning("staging %s: releasing a transfer failed: %s", self.name, e)

    def send_notif(self, peer_name: str, msg: bytes) -> None:
        """Send a user message (escaped if it looks like a staging message)."""
        self._require_open()
        self._inner.send_notif(peer_name, user_bytes(msg))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """User messages received since the last call; staging messages are consumed here."""
        self.progress()
        return self._inbox.take()

    def pool_stats(self) -> dict[str, int]:
        """Pool size and use: the pool is allocated once and never grows. quarantined_slots: slots out
        of the pool that no one may be given (held for suspect peers; our failed transfers' inner ops
        that have not ended past drain_timeout_s); suspect_peers: peers that stopped answering."""
        pool = self._pool
        quarantined = self._responder.quarantined() + self._initiator.quarantined_slots
        return {
            "pool_bytes": pool.pool_bytes,
            "allocated_bytes": 0 if pool.tensor is None else int(pool.tensor.numel()),
            "chunk_bytes": pool.chunk_bytes,
            "slots": pool.slots,
            "slots_in_use": pool.in_use,
            "peak_slots_in_use": pool.peak,
            "bytes_staged": self._copies.bytes,
            "queued": pool.queued,
            "quarantined_slots": quarantined,
            "quarantined_bytes": quarantined * pool.chunk_bytes,
            "suspect_peers": len(self._peers.suspects()),
            "staged_posts": self.posts["staged"],
            "direct_posts": self.posts["direct"],
        }

    def close(self) -> None:
        """Abort transfers and close the inner transport. Idempotent; never raises."""
        if self._closed:
            return
        try:
            for direct in list(self._direct.values()):
                self.release(direct)
            self._initiator.abort_all(TransportError(f"staging transport {self.name} closed"))
            self._outbox.flush()
        except Exception as e:  # close must never raise: it runs on shutdown and error paths
            logger.warning("staging %s: error while closing: %s", self.name, e)
        finally:
            self._closed = True
            self._inner.close()
            self._pool.free_memory()

    def __enter__(self) -> StagedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Progress --------------------------------------------------------------------------------------
    def progress(self) -> None:
        """Handle messages, poll inner ops, hand free slots out, probe silent peers. Never blocks."""
        self._require_open()
        self._inbox.read()
        self._initiator.poll()
        self._peers.poll_probes()
        self._pool.grant()
        if self._pool.allocated:
            self._peers.probe(self._busy_peers, self._waiting_peers, self._pool.probe_addr)
        self._outbox.flush()

    def busy(self) -> bool:
        """A transfer of ours, or a peer's that we serve, is under way (it advances when polled);
        a suspect peer's do not count: they advance only once it answers, and polling will not help."""
        return bool(self._busy_peers() - self._peers.suspects())

    def _busy_peers(self) -> set[str]:
        """Peers we hold anything for (probed when silent): those with a transfer of ours, those we hold a slot for."""
        return self._initiator.busy_peers() | self._responder.busy_peers()

    def _waiting_peers(self) -> set[str]:
        """Peers that owe us a message: a chunk of ours under way with them, a slot we hold for them."""
        return self._initiator.waiting_peers() | self._responder.busy_peers()

    def _on_error(self, peer: str, m: Error) -> None:
        if m.to_initiator:
            self._initiator.on_error(peer, m)
        else:
            self._responder.on_error(peer, m)

    def _require_open(self) -> None:
        if self._closed:
            raise TransportError(f"staging transport {self.name} is closed")

    def _require_pool(self) -> None:
        self._require_open()
        if not self._pool.allocated:
            raise TransportError(f"staging transport {self.name}: call register() first")
