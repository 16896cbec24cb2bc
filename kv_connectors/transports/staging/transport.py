"""CPU staging: a Transport wrapper that moves KV blocks through a bounded host pool (no GPUDirect needed)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import time
from typing import Any

import msgspec
import numpy as np

from kv_connectors.errors import ConfigError, PeerDisconnectedError, TransportError
from kv_connectors.layout import KVLayout, Region
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import MemoryKind, Transport, XferState
from kv_connectors.transports.staging.chunks import Chunks, chunk_plan, one_run
from kv_connectors.transports.staging.copier import Copier, CudaCopier, HostCopier
from kv_connectors.transports.staging.initiator import Chunk, Initiator
from kv_connectors.transports.staging.messages import (
    DEC,
    ENC,
    ERROR_KINDS,
    MD_MAGIC,
    MSG_MAGIC,
    Error,
    Free,
    Msg,
    Ready,
    Scatter,
    Scattered,
    Slot,
    Stage,
    StagedInfo,
    User,
    Want,
    error_kind,
    user_bytes,
)
from kv_connectors.transports.staging.responder import Responder, Serve

logger = logging.getLogger(__name__)

_BATCH_BYTES = 32 * 1024  # a peer's queued messages go out once they reach this size (engines cap notifs)
_PROBE_BYTES = 64  # liveness probes read one byte of the peer's pool into this registered word
_ABORTED_MEMORY = 4096  # (peer, transfer) ids remembered as aborted, to drop their late messages


# State ---------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class StagedXfer:
    """Handle of one staged transfer (returned by post_read/post_write; pass it to poll/release)."""

    peer_name: str
    op: str  # "READ" or "WRITE"
    num_runs: int
    nbytes: int
    num_chunks: int
    chunks_done: int = 0
    _id: int = 0
    _chunks: Chunks | None = None
    _notif: bytes = b""
    _next: int = 0
    _active: dict[int, Chunk] = dataclasses.field(default_factory=dict)
    _draining: list[tuple[Any, int | None, float]] = dataclasses.field(default_factory=list)
    _state: XferState = XferState.IN_PROGRESS
    _error: TransportError | None = None


@dataclasses.dataclass
class _Peer:
    info: StagedInfo
    metadata: bytes
    last_heard: float
    probe: Any = None
    dead: TransportError | None = None  # PeerDisconnectedError seen: gone until connect() with new metadata


# Transport -----------------------------------------------------------------------------------
class StagedTransport(Initiator, Responder):
    """The Transport Protocol around any inner Transport, through a bounded host pool.

    Only the pool (and a 64-byte probe word) is registered with the inner transport; KV blocks
    are gathered into pool slots of chunk_bytes, moved pool to pool, and scattered into the
    destination KV cache, chunk by chunk, several chunks in flight. Both peers must wrap their
    transport and connect() to each other (the responder answers over notifications). Everything
    progresses inside poll() / get_notifs() / progress(); nothing blocks and no thread is started.

    Slots are granted first come, first served; a transfer waiting for a slot rejoins the back of
    the queue after each chunk, so concurrent transfers and peers interleave. Our own transfers
    hold at most slots - 1 slots: one is always left for serving peers, so two transports that
    stage towards each other cannot deadlock (with 2 slots a transfer moves one chunk at a time).
    A peer we wait on is probed (1-byte inner READ of its pool) every probe_interval_s: a dead
    peer fails its transfers with the inner transport's error (PeerDisconnectedError), the slots
    we held for it are freed, and it stays gone (posts raise PeerDisconnectedError) until
    connect() brings new metadata (a restarted peer). Inner ops still in flight when a transfer
    fails are polled to their end (at most drain_timeout_s) before their slots are reused; the
    peer hears of the failure (ERROR) only then, so no late write of ours lands in a reused slot.
    Staging messages ride the inner transport's notifications, batched per peer and per call.
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
        self._inner = inner
        self._pool_bytes = pool_bytes
        self._chunk_bytes = chunk_bytes
        self._slots = pool_bytes // chunk_bytes
        self._copier = copier
        self._max_runs = max_runs_per_chunk
        self._probe_interval = probe_interval_s
        self._drain_timeout = drain_timeout_s
        self._pool: Any = None  # torch.Tensor once registered; never grows
        self._probe_word: Any = None
        self._pool_base = 0
        self._kind = MemoryKind.HOST
        self._device_id = 0
        self._kv: list[tuple[int, int]] = []  # (start, end) of every registered KV region
        self._kv_starts = np.zeros(0, np.int64)
        self._kv_ends = np.zeros(0, np.int64)
        self._free: collections.deque[int] = collections.deque(k * chunk_bytes for k in range(self._slots))
        self._own_slots = 0  # slots held by our own transfers (at most slots - 1)
        self._peak = 0
        self._bytes_staged = 0
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, StagedXfer] = {}  # our unfinished transfers
        self._aborting: list[StagedXfer] = []  # failed transfers whose inner ops are still draining
        self._waiters: collections.deque[StagedXfer | Serve] = collections.deque()
        self._served: dict[tuple[str, int, int], Serve] = {}
        self._aborted: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._inbox: list[tuple[str, bytes]] = []
        self._outbox: dict[str, list[Msg]] = {}
        self._outbox_bytes: dict[str, int] = {}
        self._next_id = random.getrandbits(56)  # random start: a restarted peer does not reuse ids
        self._next_probe_check = 0.0
        self._closed = False
        self._handlers = {
            Stage: self._on_stage,
            Ready: self._on_ready,
            Free: self._on_free,
            Want: self._on_want,
            Slot: self._on_slot,
            Scatter: self._on_scatter,
            Scattered: self._on_scattered,
            Error: self._on_error,
        }

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def pool(self) -> Any:
        """The pool tensor (torch uint8, pool_bytes long), None before register()."""
        return self._pool

    # Protocol: memory and peers ------------------------------------------------------------------
    def register(self, layout: KVLayout, kind: MemoryKind = MemoryKind.HOST, device_id: int = 0) -> None:
        """Allocate the pool and register it (only it) with the inner transport on the first call;
        remember the layout's regions as the KV memory transfers may touch."""
        self._require_open()
        if self._pool is None:
            self._allocate(kind, device_id)
        elif (kind, device_id) != (self._kind, self._device_id):
            raise TransportError(
                f"staging {self.name}: cannot mix {kind.value}:{device_id} KV memory with {self._kind.value}:{self._device_id}"
            )
        self._kv = sorted(self._kv + [(r.base, r.base + r.span) for r in layout.regions])
        merged: list[list[int]] = []
        for start, end in self._kv:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._kv_starts = np.array([s for s, _ in merged], np.int64)
        self._kv_ends = np.array([e for _, e in merged], np.int64)

    def _allocate(self, kind: MemoryKind, device_id: int) -> None:
        import torch

        if self._copier is None:
            self._copier = CudaCopier(device_id) if kind is MemoryKind.DEVICE else HostCopier()
        pin = kind is MemoryKind.DEVICE and torch.cuda.is_available()  # pinned: copies to it are async DMA
        pool = torch.empty(self._pool_bytes, dtype=torch.uint8, pin_memory=pin)
        probe = torch.zeros(_PROBE_BYTES, dtype=torch.uint8)
        base = pool.data_ptr()
        regions = (Region(base, self._pool_bytes, self._pool_bytes, 1), Region(probe.data_ptr(), _PROBE_BYTES, _PROBE_BYTES, 1))
        self._inner.register(KVLayout(num_blocks=1, block_size=1, regions=regions), MemoryKind.HOST, 0)
        self._pool, self._probe_word, self._pool_base = pool, probe, base
        self._kind, self._device_id = kind, device_id
        logger.info(
            "staging %s: %d-byte host pool (%d slots of %d bytes, pinned=%s) for %s KV memory",
            self.name,
            self._pool_bytes,
            self._slots,
            self._chunk_bytes,
            pin,
            kind.value,
        )

    def local_metadata(self) -> bytes:
        """The inner transport's metadata plus where our pool is."""
        self._require_pool()
        info = StagedInfo(self._inner.local_metadata(), self._pool_base, self._pool_bytes, self._chunk_bytes, self._max_runs)
        return MD_MAGIC + msgspec.msgpack.encode(info)

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Connect the inner transport; a new incarnation of a known peer fails its old transfers."""
        self._require_open()
        if not peer_metadata.startswith(MD_MAGIC):
            raise TransportError(f"peer {peer_name} metadata is not from a StagedTransport (both sides must stage)")
        try:
            info = msgspec.msgpack.decode(peer_metadata[len(MD_MAGIC) :], type=StagedInfo)
        except msgspec.DecodeError as e:
            raise TransportError(f"malformed staging metadata from {peer_name}: {e}") from e
        old = self._peers.get(peer_name)
        if old is not None and old.metadata == peer_metadata:
            return
        if old is not None:
            self._forget(peer_name, PeerDisconnectedError(f"staging peer {peer_name} was replaced (reconnected)"))
        self._inner.connect(peer_name, info.inner)
        self._peers[peer_name] = _Peer(info, bytes(peer_metadata), time.monotonic())

    def disconnect(self, peer_name: str) -> None:
        """Forget a peer: its transfers fail, the slots we hold for it are freed."""
        self._require_open()
        if peer_name in self._peers:
            self._forget(peer_name, PeerDisconnectedError(f"staging peer {peer_name} disconnected"))
        self._inner.disconnect(peer_name)

    def _forget(self, peer_name: str, err: TransportError) -> None:
        self._fail_peer(peer_name, err)
        self._drop_served(peer_name)
        peer = self._peers.pop(peer_name)
        if peer.probe is not None:
            self._inner.release(peer.probe)

    # Protocol: transfers ---------------------------------------------------------------------------
    def post_read(self, peer_name: str, plan: TransferPlan, notif: bytes) -> StagedXfer:
        """Pull plan.src (peer KV) into plan.dst (ours) chunk by chunk; notif reaches the peer after all."""
        return self._post("READ", peer_name, plan, notif)

    def post_write(self, peer_name: str, plan: TransferPlan, notif: bytes) -> StagedXfer:
        """Push plan.src (ours) into plan.dst (peer KV) chunk by chunk; notif reaches the peer after all."""
        return self._post("WRITE", peer_name, plan, notif)

    def _post(self, op: str, peer_name: str, plan: TransferPlan, notif: bytes) -> StagedXfer:
        """Argument errors raise here; engine and peer errors surface in poll()."""
        self._require_pool()
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransportError(f"staging peer {peer_name!r} is not connected (call connect first)")
        if peer.dead is not None:
            raise PeerDisconnectedError(f"staging peer {peer_name} is gone ({peer.dead}); connect it again once it has restarted")
        self._check_kv(plan.dst if op == "READ" else plan.src, plan.length, f"local side of {op}")
        chunks = chunk_plan(plan, min(self._chunk_bytes, peer.info.chunk_bytes), min(self._max_runs, peer.info.max_runs))
        self._next_id += 1
        x = StagedXfer(
            peer_name,
            op,
            plan.num_runs,
            plan.total_bytes,
            chunks.num_chunks,
            _id=self._next_id,
            _chunks=chunks,
            _notif=bytes(notif),
        )
        if chunks.num_chunks == 0:
            if notif:
                self._inner.send_notif(peer_name, user_bytes(notif))
            x._state = XferState.DONE
            return x
        self._xfers[x._id] = x
        self._waiters.append(x)
        logger.debug(
            "staged %s %s: %d runs, %d bytes, %d chunks", op, peer_name, plan.num_runs, plan.total_bytes, chunks.num_chunks
        )
        self._grant()
        self._flush()
        return x

    def poll(self, handle: StagedXfer) -> XferState:
        """Advance all staging work, then DONE or IN_PROGRESS; raises the transfer's typed error."""
        self.progress()  # also for a finished handle: peers may be waiting on us
        if handle._error is not None:
            raise handle._error
        return handle._state

    def release(self, handle: StagedXfer) -> None:
        """Forget a handle; an unfinished transfer is aborted and its slots freed. Never raises."""
        try:
            if handle._state is not XferState.DONE and handle._error is None:
                self._fail(handle, TransportError(f"staged {handle.op} with {handle.peer_name}: released before completion"))
                self._flush()
        except Exception as e:  # release must never raise (error paths call it)
            logger.warning("staging %s: releasing a transfer failed: %s", self.name, e)

    def send_notif(self, peer_name: str, msg: bytes) -> None:
        """Send a user message (escaped if it looks like a staging message)."""
        self._require_open()
        self._inner.send_notif(peer_name, user_bytes(msg))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """User messages received since the last call; staging messages are consumed here."""
        self.progress()
        out, self._inbox = self._inbox, []
        return out

    def pool_stats(self) -> dict[str, int]:
        """Pool size and use: the pool is allocated once and never grows."""
        return {
            "pool_bytes": self._pool_bytes,
            "allocated_bytes": 0 if self._pool is None else int(self._pool.numel()),
            "chunk_bytes": self._chunk_bytes,
            "slots": self._slots,
            "slots_in_use": self._slots - len(self._free),
            "peak_slots_in_use": self._peak,
            "bytes_staged": self._bytes_staged,
            "queued": len(self._waiters),
        }

    def close(self) -> None:
        """Abort transfers and close the inner transport. Idempotent; never raises."""
        if self._closed:
            return
        try:
            for x in list(self._xfers.values()):
                self._fail(x, TransportError(f"staging transport {self.name} closed"))
            self._flush()
        except Exception as e:  # close must never raise: it runs on shutdown and error paths
            logger.warning("staging %s: error while closing: %s", self.name, e)
        finally:
            self._closed = True
            self._inner.close()
            self._pool = self._probe_word = None

    def __enter__(self) -> StagedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Progress --------------------------------------------------------------------------------------
    def progress(self) -> None:
        """Handle messages, poll inner ops, hand free slots out, probe silent peers. Never blocks."""
        self._require_open()
        for peer_name, msg in self._inner.get_notifs():
            if msg.startswith(MSG_MAGIC):
                self._dispatch(peer_name, msg)
            else:
                self._inbox.append((peer_name, msg))
        self._poll_ops()
        self._grant()
        self._probe_peers()
        self._flush()

    def _dispatch(self, peer_name: str, raw: bytes) -> None:
        try:
            msgs = DEC.decode(raw[len(MSG_MAGIC) :])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("staging %s: dropped a malformed message from %s: %s", self.name, peer_name, e)
            return
        for msg in msgs:
            if isinstance(msg, User):
                self._inbox.append((peer_name, msg.payload))
                continue
            peer = self._peers.get(peer_name)
            if peer is None or peer.dead is not None:
                logger.debug("staging %s: dropped %s from unknown or gone peer %s", self.name, type(msg).__name__, peer_name)
                continue
            peer.last_heard = time.monotonic()
            copied = self._bytes_staged
            self._handlers[type(msg)](peer_name, msg)
            self._flush_after_copy(copied)

    def _poll_ops(self) -> None:
        for x in list(self._xfers.values()):
            for c in list(x._active.values()):
                if c.inner is not None and x._error is None:
                    copied = self._bytes_staged
                    self._poll_chunk(x, c)
                    self._flush_after_copy(copied)
        for x in list(self._aborting):
            self._drain(x)
        now = time.monotonic()
        for name, peer in list(self._peers.items()):
            if peer.probe is None:
                continue
            ended = self._settle(peer.probe)
            if ended is XferState.IN_PROGRESS:
                continue
            peer.probe = None
            if isinstance(ended, TransportError):
                self._probe_failed(name, ended)
            else:
                peer.last_heard = now

    def _grant(self) -> None:
        """Hand free slots to waiters in arrival order (our transfers only up to slots - 1)."""
        while self._free and self._waiters:
            pick = next((i for i, w in enumerate(self._waiters) if isinstance(w, Serve) or self._own_slots < self._slots - 1), None)
            if pick is None:
                return
            waiter = self._waiters[pick]
            del self._waiters[pick]
            copied = self._bytes_staged
            if isinstance(waiter, Serve):
                self._start_serving(waiter)
            else:
                self._start_chunk(waiter)
            self._flush_after_copy(copied)

    def _flush_after_copy(self, copied_before: int) -> None:
        """After a unit of work that copied bytes (a gather or scatter), send what it queued now
        rather than at the end of progress(): otherwise a peer waiting on that READY, FREE or STAGE
        also waits for every later chunk's copy in the same batch (a pipeline bubble: D sat idle
        ~28% of a 256 MiB staged pull). Units that only queue messages still go out in one batch."""
        if self._bytes_staged != copied_before:
            self._flush()

    def _on_error(self, peer: str, m: Error) -> None:
        if not m.to_initiator:
            self._drop_served(peer, m.xfer)
            self._aborted[(peer, m.xfer)] = None
            while len(self._aborted) > _ABORTED_MEMORY:
                self._aborted.popitem(last=False)
            return
        x = self._xfers.get(m.xfer)
        if x is not None and x.peer_name == peer:
            cls = ERROR_KINDS[m.kind] if 0 <= m.kind < len(ERROR_KINDS) else TransportError
            self._fail(x, cls(f"staged {x.op} with {peer}: the peer reported: {m.reason}"))

    # Failures ------------------------------------------------------------------------------------
    def _fail(self, x: StagedXfer, err: TransportError) -> None:
        """Fail a transfer: free its idle slots now, drain its inner ops, then tell the peer."""
        if x._state is XferState.DONE or x._error is not None:
            return
        x._error = err
        self._xfers.pop(x._id, None)
        self._waiters = collections.deque(w for w in self._waiters if w is not x)
        logger.debug("staged %s with %s failed: %s", x.op, x.peer_name, err)
        if isinstance(err, PeerDisconnectedError):
            self._mark_dead(x.peer_name, err)
        deadline = time.monotonic() + self._drain_timeout
        for c in x._active.values():
            if c.inner is not None:
                x._draining.append((c.inner, c.slot, deadline))
            elif c.slot is not None:
                self._give(c.slot, own=True)
        x._active.clear()
        self._aborting.append(x)
        self._drain(x)  # the peer hears of it once no write of ours can land in its slots

    def _fail_peer(self, peer_name: str, err: TransportError) -> None:
        """Fail every unfinished transfer of ours with that peer."""
        for x in [x for x in self._xfers.values() if x.peer_name == peer_name]:
            self._fail(x, err)

    def _drain(self, x: StagedXfer) -> None:
        keep = []
        now = time.monotonic()
        peer = self._peers.get(x.peer_name)
        gone = peer is None or peer.dead is not None  # nothing more can arrive: released handles are over
        for handle, slot, deadline in x._draining:
            if gone:
                self._inner.release(handle)
            elif self._settle(handle) is XferState.IN_PROGRESS:  # an error ends it too
                if now <= deadline:
                    keep.append((handle, slot, deadline))
                    continue
                logger.warning(
                    "staging %s: an aborted %s to %s did not end in %.0f s; reusing its slot",
                    self.name,
                    x.op,
                    x.peer_name,
                    self._drain_timeout,
                )
                self._inner.release(handle)
            if slot is not None:
                self._give(slot, own=True)
        x._draining = keep
        if not keep:
            self._aborting.remove(x)
            err = x._error or TransportError("aborted")
            self._send(x.peer_name, Error(x._id, False, error_kind(err), str(err)))

    def _probe_peers(self) -> None:
        """Probe each peer we wait on that has been silent for probe_interval_s."""
        now = time.monotonic()
        if now < self._next_probe_check:
            return
        self._next_probe_check = now + self._probe_interval / 4
        busy = {x.peer_name for x in self._xfers.values()} | {key[0] for key in self._served}
        for name in busy:
            peer = self._peers.get(name)
            if peer is None or peer.probe is not None or now - peer.last_heard < self._probe_interval:
                continue
            try:
                plan = one_run(peer.info.pool_base, self._probe_word.data_ptr(), 1)
                peer.probe = self._inner.post_read(name, plan, b"")
            except TransportError as e:
                self._probe_failed(name, e)

    def _probe_failed(self, name: str, err: TransportError) -> None:
        if not isinstance(err, PeerDisconnectedError):  # a dead peer is logged once, by _mark_dead
            logger.warning("staging %s: liveness probe of %s failed: %s", self.name, name, err)
        failed = type(err)(f"staging peer {name} failed a liveness probe: {err}")
        self._fail_peer(name, failed)  # a PeerDisconnectedError also marks the peer dead
        if name in self._peers:
            self._peers[name].last_heard = time.monotonic()

    def _mark_dead(self, name: str, err: TransportError) -> None:
        """The engine says the peer is gone: fail its transfers, free what we held for it, send it nothing more."""
        peer = self._peers.get(name)
        if peer is None or peer.dead is not None:
            return
        peer.dead = err
        logger.warning("staging %s: peer %s is gone: %s", self.name, name, err)
        if peer.probe is not None:
            self._inner.release(peer.probe)
            peer.probe = None
        self._fail_peer(name, err)
        self._drop_served(name)

    # Helpers -------------------------------------------------------------------------------------
    def _settle(self, handle: Any) -> XferState | TransportError:
        """Poll an inner op; one that has ended (DONE, or failed: its error is returned) is released."""
        try:
            state = self._inner.poll(handle)
        except TransportError as e:
            self._inner.release(handle)
            return e
        if state is XferState.DONE:
            self._inner.release(handle)
        return state

    def _take(self, own: bool) -> int:
        slot = self._free.popleft()
        self._own_slots += own
        self._peak = max(self._peak, self._slots - len(self._free))
        return slot

    def _give(self, slot: int | None, own: bool) -> None:
        assert slot is not None
        self._free.append(slot)
        self._own_slots -= own

    def _copy(self, dst: np.ndarray, src: np.ndarray, length: np.ndarray) -> None:
        """Copy length[i] bytes src[i] -> dst[i] with the copier and wait; errors become TransportError."""
        assert self._copier is not None
        try:
            self._copier.copy(list(zip(dst.tolist(), src.tolist(), length.tolist())))
            self._copier.synchronize()
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"staging {self.name}: copy failed: {type(e).__name__}: {e}") from e
        self._bytes_staged += int(length.sum())

    def _send(self, peer: str, msg: Msg) -> None:
        """Queue a message; a peer's queue goes out as one notification (see _flush). Messages to a
        peer that is gone are dropped (its transfers have failed already)."""
        state = self._peers.get(peer)
        if state is None or state.dead is not None:
            return
        queue = self._outbox.setdefault(peer, [])
        queue.append(msg)
        self._outbox_bytes[peer] = self._outbox_bytes.get(peer, 0) + 32 + len(getattr(msg, "runs", b""))
        if self._outbox_bytes[peer] >= _BATCH_BYTES:
            self._flush(peer)

    def _flush(self, only: str | None = None) -> None:
        """Send the queued messages (one notification per peer); a failure fails that peer's transfers."""
        for peer in [only] if only is not None else list(self._outbox):
            msgs = self._outbox.pop(peer, None)
            self._outbox_bytes.pop(peer, None)
            if not msgs:
                continue
            try:
                self._inner.send_notif(peer, MSG_MAGIC + ENC.encode(msgs))
            except TransportError as e:
                logger.debug("staging %s: could not send %d messages to %s: %s", self.name, len(msgs), peer, e)
                if isinstance(e, PeerDisconnectedError):
                    self._mark_dead(peer, e)
                self._fail_peer(peer, e)

    def _check_kv(self, addr: np.ndarray, length: np.ndarray, what: str) -> None:
        """Every run must lie inside registered KV memory (copies use raw addresses)."""
        if addr.size == 0:
            return
        if self._kv_starts.size == 0:
            raise TransportError(f"{what}: no KV memory is registered")
        idx = np.searchsorted(self._kv_starts, addr, side="right") - 1
        inside = (idx >= 0) & (length >= 0) & (addr + length <= self._kv_ends[np.maximum(idx, 0)])
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise TransportError(
                f"{what}: run {bad} ({int(addr[bad]):#x}, {int(length[bad])} bytes) is not inside registered KV memory"
            )

    def _require_open(self) -> None:
        if self._closed:
            raise TransportError(f"staging transport {self.name} is closed")

    def _require_pool(self) -> None:
        self._require_open()
        if self._pool is None:
            raise TransportError(f"staging transport {self.name}: call register() first")
