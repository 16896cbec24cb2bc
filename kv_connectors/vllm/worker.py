"""Worker side of the connector: owns the transport, serves handshakes, moves blocks, reports results."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import KVConnectorError, PeerDisconnectedError
from kv_connectors.layout import KVLayout
from kv_connectors.plan import plan_transfer
from kv_connectors.state import RecvPhase, RecvTask, SendLeases
from kv_connectors.transport import Transport, XferState
from kv_connectors.vllm.metadata import ConnectorMetadata

logger = logging.getLogger(__name__)

TransportFactory = Callable[[str], Transport]
PeerKey = tuple[str, str, int]


@dataclasses.dataclass
class _Peer:
    """A producer we read from: known once its handshake answered."""

    future: concurrent.futures.Future | None
    agent_name: str = ""
    layout: KVLayout | None = None
    error: str | None = None


@dataclasses.dataclass
class RecvTotals:
    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    blocks: int = 0
    descriptors: int = 0
    seconds: float = 0.0


class WorkerSide:
    """Runs in the Worker process. All transport calls happen on the thread vLLM calls us on;
    the handshake thread only does side-channel I/O."""

    def __init__(self, cfg: ConnectorConfig, rank: int, make_transport: TransportFactory) -> None:
        self._cfg = cfg
        self._rank = rank
        self._make_transport = make_transport
        self._transport: Transport | None = None
        self._layout: KVLayout | None = None
        self._compat: wire.CompatInfo | None = None
        self._server: sidechannel.SideChannelServer | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvc-handshake")
        self._peers: dict[PeerKey, _Peer] = {}
        self._tasks: dict[str, RecvTask] = {}
        self._leases = SendLeases()
        self._totals = RecvTotals()
        self._stats = self._snapshot()

    # set-up ---------------------------------------------------------------------------------
    def register(self, layout: KVLayout, compat: wire.CompatInfo) -> None:
        self._layout, self._compat = layout, compat
        # Bind first: a port in use must fail start-up before anything else is built.
        self._server = sidechannel.SideChannelServer(
            self._cfg.side_channel_host,
            self._cfg.side_channel_port_for_rank(self._rank),
            compat.hash(),
            self._handle,
        )
        try:
            self._transport = self._make_transport(f"{self._cfg.engine_id}-rank{self._rank}")
            self._transport.register(layout)
        except BaseException:
            self._server.close()
            raise
        logger.info(
            "KV cache registered: %d blocks x %d bytes in %d regions, compat hash %s",
            layout.num_blocks, layout.block_bytes, len(layout.regions), compat.hash(),
        )

    def _handle(self, body: wire.Body) -> wire.Body:
        """Side-channel requests (handshake thread of the server; reads immutable state only)."""
        if isinstance(body, wire.StatsRequest):
            return self._stats
        if not isinstance(body, wire.HandshakeRequest):
            return wire.ErrorReply("bad_request", f"unexpected {type(body).__name__}")
        if self._transport is None or self._layout is None or self._compat is None:
            return wire.ErrorReply("not_ready", "KV cache not registered yet")
        if body.compat.hash() != self._compat.hash():
            diff = self._compat.diff(body.compat, mine="server", theirs="client")
            logger.error("refused incompatible peer %s: %s", body.engine_id, diff)
            return wire.ErrorReply("incompatible", diff)
        logger.info("handshake from engine %s rank %d", body.engine_id, body.rank)
        return wire.HandshakeReply(
            engine_id=self._cfg.engine_id,
            agent_name=self._transport.name,
            agent_metadata=self._transport.local_metadata(),
            layout=wire.LayoutMsg.from_layout(self._layout),
        )

    # per step ---------------------------------------------------------------------------------
    def start_load(self, meta: ConnectorMetadata | None) -> None:
        if meta is not None:
            self._ingest(meta)
        self._progress()

    def _ingest(self, meta: ConnectorMetadata) -> None:
        now = time.monotonic()
        for rid, num_blocks in meta.reqs_to_send.items():
            self._leases.add(rid, num_blocks, now, self._cfg.lease_s)
        for rid, spec in meta.reqs_to_recv.items():
            deadline = now + self._cfg.handshake_timeout_s + self._cfg.transfer_timeout_s
            task = RecvTask(
                request_id=rid if spec.report else f"release:{rid}",
                peer_key=spec.peer_key,
                remote_request_id=spec.remote_request_id,
                local_block_ids=list(spec.local_block_ids),
                remote_block_ids=list(spec.remote_block_ids),
                deadline=deadline,
                started=now,
            )
            self._tasks[task.request_id] = task
            self._ensure_peer(spec.peer_key)
        for rid, reason in meta.reqs_failed.items():
            task = RecvTask(rid, ("", "", 0), "", [], [], now)
            task.fail(reason)
            self._tasks[rid] = task

    def _ensure_peer(self, key: PeerKey) -> None:
        peer = self._peers.get(key)
        if peer is not None and peer.error is None:
            return
        assert self._compat is not None
        request = wire.HandshakeRequest(self._cfg.engine_id, self._rank, self._compat)
        _engine_id, host, port = key
        future = self._pool.submit(
            sidechannel.request, host, port, request, self._compat.hash(), self._cfg.handshake_timeout_s
        )
        self._peers[key] = _Peer(future)

    def _resolve_peers(self) -> None:
        assert self._transport is not None
        for key, peer in self._peers.items():
            if peer.future is None or not peer.future.done():
                continue
            future, peer.future = peer.future, None
            try:
                reply = future.result()
                if not isinstance(reply, wire.HandshakeReply) or reply.engine_id != key[0]:
                    raise KVConnectorError(
                        f"side channel {key[1]}:{key[2]} answered for engine "
                        f"{getattr(reply, 'engine_id', '?')}, expected {key[0]}"
                    )
                self._transport.connect(reply.agent_name, reply.agent_metadata)
                peer.agent_name, peer.layout = reply.agent_name, reply.layout.to_layout()
                logger.info("connected to producer %s at %s:%d", key[0], key[1], key[2])
            except Exception as e:  # boundary: a failed handshake fails requests, never the step
                peer.error = str(e)
                logger.error("handshake with %s at %s:%d failed: %s", key[0], key[1], key[2], e)

    def _progress(self) -> None:
        if self._transport is None:
            return
        self._resolve_peers()
        now = time.monotonic()
        for task in self._tasks.values():
            if task.phase is RecvPhase.HANDSHAKE:
                self._advance_handshake(task, now)
            elif task.phase is RecvPhase.TRANSFER:
                self._advance_transfer(task, now)

    def _advance_handshake(self, task: RecvTask, now: float) -> None:
        peer = self._peers[task.peer_key]
        if peer.error is not None:
            task.fail(f"handshake with producer failed: {peer.error}")
        elif peer.layout is not None:
            self._post(task, peer)
        elif now > task.deadline:
            task.fail("handshake with producer timed out")

    def _post(self, task: RecvTask, peer: _Peer) -> None:
        assert self._transport is not None and self._layout is not None and peer.layout is not None
        notif = wire.encode(wire.TransferDone(task.remote_request_id, self._cfg.engine_id), self._compat_hash)
        started = time.monotonic()  # engines may copy inside the post call (NIXL over cma does)
        try:
            plan = plan_transfer(peer.layout, task.remote_block_ids, self._layout, task.local_block_ids)
            task.handle = self._transport.post_read(peer.agent_name, plan, notif)
        except KVConnectorError as e:
            self._fail_transfer(task, e)
            return
        task.phase = RecvPhase.TRANSFER
        task.num_bytes, task.num_descriptors = plan.total_bytes, plan.num_runs
        task.started = started
        task.deadline = started + self._cfg.transfer_timeout_s

    def _advance_transfer(self, task: RecvTask, now: float) -> None:
        assert self._transport is not None
        try:
            state = self._transport.poll(task.handle)
        except KVConnectorError as e:
            self._fail_transfer(task, e)
            return
        if state is XferState.DONE:
            self._transport.release(task.handle)
            task.handle = None
            task.phase = RecvPhase.DONE
            t = self._totals
            t.transfers += 1
            t.bytes += task.num_bytes
            t.blocks += len(task.local_block_ids)
            t.descriptors += task.num_descriptors
            elapsed = time.monotonic() - task.started
            t.seconds += elapsed
            logger.debug("request %s: %d bytes in %.6f s", task.request_id, task.num_bytes, elapsed)
        elif now > task.deadline:
            self._fail_transfer(task, KVConnectorError(f"transfer timed out after {self._cfg.transfer_timeout_s:g} s"))

    def _fail_transfer(self, task: RecvTask, error: Exception) -> None:
        assert self._transport is not None
        if task.handle is not None:
            self._transport.release(task.handle)
            task.handle = None
        peer = self._peers.get(task.peer_key)
        if isinstance(error, PeerDisconnectedError) and peer is not None:
            peer.error = str(error)  # the next request handshakes again
        elif peer is not None and peer.agent_name:
            self._notify_quietly(peer.agent_name, task.remote_request_id)
        task.fail(f"KV transfer failed: {error}")

    def _notify_quietly(self, agent_name: str, remote_request_id: str) -> None:
        """Tell P to free its blocks after a failed read; P's lease covers a lost notice."""
        assert self._transport is not None
        try:
            msg = wire.encode(wire.TransferDone(remote_request_id, self._cfg.engine_id), self._compat_hash)
            self._transport.send_notif(agent_name, msg)
        except KVConnectorError as e:
            logger.debug("could not notify producer %s: %s", agent_name, e)

    @property
    def _compat_hash(self) -> str:
        assert self._compat is not None
        return self._compat.hash()

    # results ----------------------------------------------------------------------------------
    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._progress()
        sending = self._take_sending()
        recving: set[str] = set()
        failed: set[str] = set()
        for rid in [rid for rid, t in self._tasks.items() if t.phase in (RecvPhase.DONE, RecvPhase.FAILED)]:
            task = self._tasks.pop(rid)
            if task.phase is RecvPhase.FAILED:
                self._totals.failures += 1
                logger.error("request %s: %s", rid, task.error)
            if rid.startswith("release:"):
                continue
            recving.add(rid)
            if task.phase is RecvPhase.FAILED:
                failed.add(rid)
        self._stats = self._snapshot()
        return sending, recving, failed

    def _take_sending(self) -> set[str]:
        if self._transport is None:
            return set()
        now = time.monotonic()
        for _agent, msg in self._transport.get_notifs():
            try:
                body = wire.decode(msg, self._compat_hash)
            except KVConnectorError as e:
                logger.warning("dropped a bad notification: %s", e)
                continue
            if isinstance(body, wire.TransferDone):
                self._leases.notice(body.request_id, now)
        done, expired = self._leases.take_finished(now)
        for rid in expired:
            logger.warning("request %s: decode side never read its KV; freed after %.0f s lease", rid, self._cfg.lease_s)
        return done | expired

    def _snapshot(self) -> wire.StatsReply:
        t = self._totals
        return wire.StatsReply(
            engine_id=self._cfg.engine_id,
            held_requests=self._leases.held_requests,
            held_blocks=self._leases.held_blocks,
            completed_sends=self._leases.completed,
            expired_leases=self._leases.expired,
            recv_transfers=t.transfers,
            recv_failures=t.failures,
            recv_bytes=t.bytes,
            recv_blocks=t.blocks,
            recv_descriptors=t.descriptors,
            recv_seconds=t.seconds,
        )

    def stats(self) -> Mapping[str, Any]:
        return {f: getattr(self._stats, f) for f in self._stats.__struct_fields__}

    def close(self) -> None:
        for task in self._tasks.values():
            if task.handle is not None and self._transport is not None:
                self._transport.release(task.handle)
        self._tasks.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
