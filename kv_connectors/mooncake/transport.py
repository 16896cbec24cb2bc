"""Mooncake transport: the Transport Protocol on Mooncake's TransferEngine (P2P handshake), return codes mapped to ours.

The engine is loaded in engine.py; each peer's batches run on its thread (peer.py: PeerWorker); the handle is
xfer.py's, the handshake's and notifications' bytes metadata.py's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from kv_connectors.errors import ConfigError, PeerDisconnectedError, TransportError
from kv_connectors.layout import KVLayout
from kv_connectors.mooncake.engine import load_mooncake
from kv_connectors.mooncake.metadata import PeerInfo, decode_metadata, decode_notif, encode_metadata, encode_notif
from kv_connectors.mooncake.peer import PeerWorker, reachable
from kv_connectors.mooncake.xfer import MooncakeXfer, Notify
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import MemoryKind, Op, XferState
from kv_connectors.transports.intervals import Ranges, merge_ranges

logger = logging.getLogger(__name__)

_SCRATCH_BYTES = 64  # registered on every side: notification-only transfers read 1 byte of the peer's
_JOIN_S = 2.0
_ENGINE_TIMEOUT_S = 600  # MC_TRANSFER_TIMEOUT unless set (see MooncakeTransport)
_WATCH_S = 1.0  # how often a peer whose failed batch may still land is probed
_NAMES: weakref.WeakValueDictionary[str, MooncakeTransport] = weakref.WeakValueDictionary()
_NAMES_LOCK = threading.Lock()


class MooncakeTransport:
    """Transport on one Mooncake TransferEngine in P2PHANDSHAKE mode (no metadata server).

    `name` is how peers and notifications know us; the engine's address (session id "host:rpc_port")
    travels in local_metadata(). post_* return at once and poll() never blocks: a thread per peer
    runs its transfers in order in batches of <= max_batch runs (the engine's TCP queue holds 1024
    per peer), then sends the notification (Mooncake's notify, carried by a 1-byte read), so it
    reaches the peer after all data. The engine's status wait spins a core: the thread naps through
    most of each batch first. A dead peer fails in ~0.1-2 s (PeerDisconnectedError), a frozen one
    after the engine's timeout (MC_TRANSFER_TIMEOUT; TransferTimeoutError). Not thread-safe: one
    thread drives a transport.

    Nothing stops a submitted batch: abort() and release() only keep later batches from starting,
    and the engine's own timeout error does not end the batch either (measured over TCP: a 32 MiB
    read failed with the peer stopped, and after the peer resumed its bytes kept landing for up to a
    second, while a 1-block read posted after the resume completed in 4-13 ms, so a later transfer
    proves nothing). So settled() is true only once the job completed, failed before or between
    batches, or its peer's process is gone (its port refuses connections, probed every second while
    a failed batch may still land; or a new incarnation replaced it). MC_TRANSFER_TIMEOUT defaults
    to _ENGINE_TIMEOUT_S here (unless set): a stalled peer that resumes then completes the batch
    (settled) instead of failing it with the bytes still on their way.
    """

    def __init__(
        self, name: str, *, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", max_batch: int = 1000
    ) -> None:
        if not name:
            raise ConfigError("Mooncake transport name must be a non-empty string")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1 (runs per engine batch), got {max_batch}")
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(_ENGINE_TIMEOUT_S))  # read by each new engine
        mc = load_mooncake()
        with _NAMES_LOCK:
            if name in _NAMES:
                raise ConfigError(f"a Mooncake transport named {name!r} is already open in this process")
            _NAMES[name] = self
        self.name = name
        self._mc = mc
        self._max_batch = max_batch
        self._peers: dict[str, PeerWorker] = {}
        self._live: dict[int, MooncakeXfer] = {}
        self._watched: list[MooncakeXfer] = []  # failed jobs whose batch may still land: until their peer is gone
        self._watch_cv = threading.Condition()
        self._watcher: threading.Thread | None = None
        self._registered: list[tuple[int, int]] = []  # (start, end) of every range registered with the engine
        self._ranges = Ranges()  # the same, for checking our side of each plan
        self._scratch = np.zeros(_SCRATCH_BYTES, dtype=np.uint8)
        engine = mc.TransferEngine()
        rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            self._release_name()
            raise TransportError(f"Mooncake initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}, {device_name!r}) failed: rc {rc}")
        self._engine: Any = engine
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"
        self._register_ranges([(int(self._scratch.ctypes.data), _SCRATCH_BYTES)], "*")
        logger.info("Mooncake transport %s up at %s (%s, max batch %d)", name, self.session_id, protocol, max_batch)

    def register(self, layout: KVLayout, kind: MemoryKind = MemoryKind.HOST, device_id: int = 0) -> None:
        """Register every region of the layout (base, span); overlapping regions are merged first."""
        self._require_open()
        if kind is MemoryKind.DEVICE and not getattr(self._mc, "SUPPORT_CUDA", False):
            raise TransportError("this Mooncake build has no CUDA support: it cannot register device memory")
        location = "*" if kind is MemoryKind.HOST else f"cuda:{device_id}"
        merged = merge_ranges((r.base, r.base + r.span) for r in layout.regions)  # the engine refuses overlaps (rc -7)
        known = set(self._registered)
        ranges = [(s, e - s) for s, e in merged if (s, e) not in known]
        self._register_ranges(ranges, location)
        logger.debug("Mooncake %s registered %d ranges (%s)", self.name, len(ranges), location)

    def _register_ranges(self, ranges: list[tuple[int, int]], location: str) -> None:
        if not ranges:
            return
        rc = self._engine.batch_register_memory([a for a, _ in ranges], [n for _, n in ranges], location)
        if rc != 0:
            overlap = " (overlaps memory registered before)" if rc == -7 else ""
            raise TransportError(f"Mooncake {self.name}: registering {len(ranges)} ranges failed: rc {rc}{overlap}")
        self._registered += [(a, a + n) for a, n in ranges]
        self._registered.sort()
        self._ranges.add((a, a + n) for a, n in ranges)

    def local_metadata(self) -> bytes:
        """Opaque bytes for the handshake: our engine's session id and scratch address."""
        self._require_open()
        return encode_metadata(PeerInfo(self.session_id, int(self._scratch.ctypes.data), list(self._ranges.spans)))

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Map peer_name to its engine; a known name with new metadata (restarted peer) is replaced."""
        self._require_open()
        info = decode_metadata(peer_metadata)
        old = self._peers.get(peer_name)
        if old is not None and old.metadata == peer_metadata:
            return  # same incarnation
        self._forget(peer_name, "replaced by a new connection", replaced=old is not None)
        self._peers[peer_name] = PeerWorker(
            self.name, self._engine, self._mc, peer_name, info, self._scratch, self._max_batch, bytes(peer_metadata), self._watch
        )
        logger.info("Mooncake %s connected to %s at %s", self.name, peer_name, info.session_id)

    def disconnect(self, peer_name: str) -> None:
        """Forget a peer (its queued transfers fail); unknown names are ignored."""
        self._require_open()
        if peer_name in self._peers:
            self._forget(peer_name, "disconnected")
            logger.info("Mooncake %s disconnected from %s", self.name, peer_name)

    def post_read(self, peer_name: str, plan: TransferPlan, notif: bytes) -> MooncakeXfer:
        """Start copying plan.src (peer memory) into plan.dst (ours); notif reaches the peer when done."""
        return self._post(Op.READ, peer_name, plan, notif)

    def post_write(self, peer_name: str, plan: TransferPlan, notif: bytes) -> MooncakeXfer:
        """Start copying plan.src (ours) into plan.dst (peer memory); notif reaches the peer when done."""
        return self._post(Op.WRITE, peer_name, plan, notif)

    def _post(self, op: Op, peer_name: str, plan: TransferPlan, notif: bytes) -> MooncakeXfer:
        self._require_open()
        worker = self._require_peer(peer_name)
        self._check_local(op, plan)
        self._check_remote(op, plan, worker.ranges, peer_name)
        batches = -(-plan.num_runs // self._max_batch)
        handle = MooncakeXfer(peer_name, op, plan.num_runs, plan.total_bytes, batches, plan, encode_notif(notif) if notif else None)
        if plan.num_runs == 0 and not notif:
            handle._state, handle._ended = XferState.DONE, True
            return handle
        worker.submit(handle)
        self._live[id(handle)] = handle
        logger.debug("Mooncake %s %s: %d runs, %d bytes, %d batches", op, peer_name, plan.num_runs, plan.total_bytes, batches)
        return handle

    @staticmethod
    def _check_remote(op: Op, plan: TransferPlan, ranges: Ranges, peer_name: str) -> None:
        """The peer's side against the ranges it advertised: its engine would refuse only the runs
        outside them and move the rest, so a bad plan is refused whole here, before anything moves."""
        addr = plan.src if op is Op.READ else plan.dst
        bad = ranges.first_outside(addr, plan.length)
        if bad is not None:
            raise TransportError(
                f"Mooncake {op} with {peer_name}: remote run {bad} ({int(addr[bad]):#x}, {int(plan.length[bad])} "
                "bytes) is not inside the memory the peer registered"
            )

    def _check_local(self, op: Op, plan: TransferPlan) -> None:
        """TCP does not check our side's addresses: a run outside registered memory would corrupt it."""
        addr = plan.dst if op is Op.READ else plan.src
        bad = self._ranges.first_outside(addr, plan.length)
        if bad is not None:
            raise TransportError(
                f"Mooncake {op}: local run {bad} ({int(addr[bad]):#x}, {int(plan.length[bad])} "
                "bytes) is not inside registered memory"
            )

    def poll(self, handle: MooncakeXfer) -> XferState:
        """Non-blocking: DONE or IN_PROGRESS; raises PeerDisconnectedError / TransportError on failure."""
        if handle._error is not None:
            raise handle._error
        if handle._state is XferState.DONE:
            return XferState.DONE
        if handle._cancelled:
            raise TransportError(f"{handle.op} with {handle.peer_name}: handle was released")
        self._require_open()
        return XferState.IN_PROGRESS

    def abort(self, handle: MooncakeXfer) -> None:
        """Start no further batch of it (the one in the engine runs on). Never raises."""
        handle._cancelled = True

    def settled(self, handle: MooncakeXfer) -> bool:
        """Completed, failed with no batch in the engine, or its peer's process is gone (see the class)."""
        return handle._ended

    def _watch(self, job: MooncakeXfer) -> None:
        """(Peer thread) a failed batch may still land: watch its peer until its process is gone."""
        with self._watch_cv:
            self._watched.append(job)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, name=f"mooncake-{self.name}-settle", daemon=True)
                self._watcher.start()
            self._watch_cv.notify()

    def _watch_loop(self) -> None:
        while True:
            with self._watch_cv:
                self._watch_cv.wait_for(lambda: self._watched or self._engine is None, timeout=_WATCH_S)
                if self._engine is None:
                    return
                jobs = list(self._watched)
            for job in jobs:
                if not job._ended and reachable(job._session):
                    continue
                job._ended = True  # the peer's process is gone (or a new one replaced it): nothing more can land
                with self._watch_cv:
                    self._watched.remove(job)
            time.sleep(_WATCH_S)

    def release(self, handle: MooncakeXfer) -> None:
        """Forget a handle; an unfinished transfer starts no further batch (the one in the engine runs on). Never raises."""
        self._live.pop(id(handle), None)
        handle._cancelled = True
        if handle._state is not XferState.DONE and handle._error is None:
            handle._error = TransportError(f"{handle.op} with {handle.peer_name}: released before completion")

    def send_notif(self, peer_name: str, msg: bytes) -> None:
        """Queue a small message to a connected peer, after our earlier transfers to it. Failures are logged."""
        self._require_open()
        worker = self._require_peer(peer_name)
        worker.submit(MooncakeXfer(peer_name, Notify.NOTIF, 0, 0, 0, None, encode_notif(msg), _quiet=True))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Messages received since the last call, as (sender's transport name, message)."""
        engine = self._require_open()
        out: list[tuple[str, bytes]] = []
        for n in engine.get_notifies():
            try:
                out.append((n.name, decode_notif(n.msg)))
            except ValueError as e:  # UnicodeDecodeError (not UTF-8) or a broken base64 payload
                logger.warning("Mooncake %s: dropped a malformed notification: %s", self.name, e)
        return out

    def close(self) -> None:
        """Stop peer threads, deregister memory and release the engine. Idempotent; never raises."""
        engine = getattr(self, "_engine", None)
        if engine is None:
            return
        self._engine = None
        with self._watch_cv:
            self._watch_cv.notify_all()  # the settle watcher ends
        try:
            for handle in list(self._live.values()):
                self.release(handle)
            workers = list(self._peers.values())
            self._peers.clear()
            for w in workers:
                w.stop("transport closed")
            deadline = time.monotonic() + _JOIN_S
            for w in workers:
                w.thread.join(max(0.0, deadline - time.monotonic()))
            stuck = [w.peer_name for w in workers if w.thread.is_alive()]
            if stuck:
                # Their engine calls end by the engine's own timeout; the engine lives on in those threads.
                logger.warning("Mooncake %s: closing with transfers to %s still in the engine", self.name, stuck)
            elif self._registered:
                rc = engine.batch_unregister_memory([s for s, _ in self._registered])
                if rc != 0:
                    logger.warning("Mooncake %s: unregistering memory failed: rc %s", self.name, rc)
            self._registered.clear()
        except Exception as e:  # close() must never raise: it runs on shutdown and error paths
            logger.warning("Mooncake %s: error while closing: %s", self.name, e)
        finally:
            self._release_name()
        logger.debug("Mooncake transport %s closed", self.name)

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release_name(self) -> None:
        with _NAMES_LOCK:
            if _NAMES.get(self.name) is self:
                del _NAMES[self.name]

    def _require_open(self) -> Any:
        engine = getattr(self, "_engine", None)
        if engine is None:
            raise TransportError(f"Mooncake transport {self.name} is closed")
        return engine

    def _require_peer(self, peer_name: str) -> PeerWorker:
        worker = self._peers.get(peer_name)
        if worker is None:
            raise TransportError(f"Mooncake peer {peer_name!r} is not connected (call connect first)")
        return worker

    def _forget(self, peer_name: str, why: str, replaced: bool = False) -> None:
        """Stop the peer's thread (queued transfers fail with PeerDisconnectedError) and drop it.
        replaced: a new incarnation took its name, so the old process and its transfers are gone."""
        worker = self._peers.pop(peer_name, None)
        if worker is None:
            return
        worker.stop(why)
        for handle in [h for h in self._live.values() if h.peer_name == peer_name]:
            if handle._state is not XferState.DONE and handle._error is None:
                handle._error = PeerDisconnectedError(f"{handle.op} with {peer_name}: peer {why}")
            handle._ended = handle._ended or replaced or not handle._in_engine
            self._live.pop(id(handle), None)
