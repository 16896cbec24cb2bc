"""Worker side of the engine: owns the transport and side channel; steps the receiver and sender.

Pure (no vLLM import): the clock, the side channel (server factory and client) and the transport
factory are injected, so every path runs in unit tests over the memory transport with a fake clock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig, Staging
from kv_connectors.consumer.receiver import Receiver
from kv_connectors.consumer.renewer import Renewer
from kv_connectors.consumer.tasks import FailReason, RecvKind, RecvTask
from kv_connectors.counters import Phase
from kv_connectors.errors import ConfigError, KVConnectorError, TransferParamsError, TransportError
from kv_connectors.fence import LeaseWords
from kv_connectors.idle import IdlePacer
from kv_connectors.layout import KVLayout, reader_count, source_ranks
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.producer.admission import tp_refusal
from kv_connectors.producer.sender import Sender
from kv_connectors.specs import RecvSpec, StepMetadata
from kv_connectors.transports.base import MemoryKind, Transport
from kv_connectors.transports.staging import StagedTransport

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)
_P_TP_TTL_S = 60.0  # how long a producer's TP size, asked once, is trusted (a restart may change it)
# The longest wait after an empty step while a transfer is in flight (its completion is polled).
POLL_WAIT_S = 0.0005
# With nothing held or under way (plain decoding), steps skip the engine's work but for this often:
# the transport's notifications a peer may still send are drained then (bounded, never lost).
QUIET_POLL_S = 0.05

TransportFactory = Callable[[str], Transport]


class Server(Protocol):
    compat_hash: str

    def close(self) -> None: ...


# (bind host, port, compat hash, handler, max message bytes, shared secret) -> a listening server
ServerFactory = Callable[[str, int, str, Callable[[wire.Body], wire.Body], int, bytes | None], Server]


class _WakingClient:
    """The side-channel client whose every answer (or failure) wakes the engine's idle wait."""

    def __init__(self, inner: sidechannel.Client, wake: Callable[[], None]) -> None:
        self._inner = inner
        self._wake = wake

    def submit(
        self, host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float
    ) -> concurrent.futures.Future[wire.Body]:
        future = self._inner.submit(host, port, body, compat_hash, timeout_s)
        future.add_done_callback(lambda _f: self._wake())
        return future

    def forget(self, host: str, port: int) -> None:
        self._inner.forget(host, port)

    def listening(self, host: str, port: int) -> concurrent.futures.Future[bool]:
        future = self._inner.listening(host, port)
        future.add_done_callback(lambda _f: self._wake())
        return future

    def close(self) -> None:
        self._inner.close()


class WorkerEngine:
    """Runs in the Worker process, on the thread vLLM calls it on (every transport call happens
    there); the side-channel thread only answers handshakes, claims and stats and queues push
    requests."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        make_transport: TransportFactory,
        transport_label: str = "",
        *,
        serve: ServerFactory = sidechannel.SideChannelServer,
        client: sidechannel.Client | None = None,
        clock: Callable[[], float] = time.monotonic,
        tp_size: int = 1,
        idle_wait: Callable[[float], bool] | None = None,
    ) -> None:
        """idle_wait: the blocking wait of an empty step (kv_connectors.idle; tests record it)."""
        self._cfg = cfg
        self._tp_size = tp_size
        self.epoch = uuid.uuid4().hex[:16]  # this start of the engine: peers tell restarts apart by it
        self._serve = serve
        self.pacer = IdlePacer(cfg.idle_wait_ms / 1000.0, idle_wait)
        self._idle_step = False  # the current step schedules no token (from the scheduler side)
        self._idle_steps = 0
        self._last_progress = float("-inf")  # when the engine last advanced (kv_connectors.worker._skips_step)
        self._step_did_work = True  # this step's start_load ingested or advanced something
        inner = client or sidechannel.SideChannelClient(secret=cfg.side_channel_secret)
        self._client: sidechannel.Client = _WakingClient(inner, self.pacer.wake)
        self._clock = clock
        self._transport_label = transport_label
        self._rank = rank
        self._make_transport = make_transport
        self._transport: Transport | None = None
        self._layout: KVLayout | None = None
        self._compat: wire.CompatInfo | None = None
        self._server: Server | None = None
        self._receiver: Receiver | None = None
        self._sender: Sender | None = None
        self._renewer: Renewer | None = None
        self._stats = wire.StatsReply(engine_id=cfg.engine_id, rank=rank, tp_size=tp_size)
        self._local_metadata = b""
        self._hash = ""  # the compatibility hash, once registered
        self._notices: list[wire.TransferDone] = []  # for the sender, collected between results
        self._staging: StagedTransport | None = None
        self._words: LeaseWords | None = None  # P: this rank's lease words (kv_connectors.fence)
        self._scratch: LeaseWords | None = None  # D: where P's words are read to
        self._renewing: dict[str, list[str]] = {}  # request id -> its renewals (one per P rank read)
        # P's TP size where the params do not state it (transfer-id flow), asked of P's rank 0 (a
        # stats request any rank answers) and kept _P_TP_TTL_S: (host, base port) -> (size, when).
        self._p_tp: dict[tuple[str, int], tuple[int, float]] = {}
        self._probes: dict[tuple[str, int], tuple[concurrent.futures.Future[wire.Body], float]] = {}  # and deadline
        self._deferred: list[tuple[str, RecvSpec]] = []  # loads waiting for their P's TP size

    @property
    def rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self._rank

    # set-up ---------------------------------------------------------------------------------
    def register(
        self,
        layout: KVLayout,
        compat: wire.CompatInfo,
        kind: MemoryKind = MemoryKind.HOST,
        device_id: int = 0,
        layer_regions: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        # Bind first: a port in use must fail start-up before anything else is built.
        server = self._serve(
            self._cfg.bind_host,
            self._cfg.side_channel_port_for_rank(self._rank),
            compat.hash(),
            self._handle_and_wake,
            self._cfg.side_channel_max_msg_kib * 1024,
            self._cfg.side_channel_secret or None,
        )
        try:
            transport = self._registered_transport(layout, kind, device_id)
        except BaseException:
            server.close()
            raise
        # Both peers must move data the same way (same engine; staged or not).
        kind_of_transfer = self._transport_label + ("+staging" if self._staging is not None else "")
        compat = msgspec.structs.replace(compat, transport=kind_of_transfer)
        self._hash = server.compat_hash = compat.hash()
        self._layout, self._compat, self._transport = layout, compat, transport
        try:
            self._register_words(transport, layout, kind)
        except BaseException:
            transport.close()
            server.close()
            raise
        # Fixed once the memory is registered; read here so that the side-channel thread never calls
        # into the engine (NIXL agents are not thread-safe, and a long post on the engine thread
        # would stall every handshake behind the engine's lock).
        self._local_metadata = transport.local_metadata()
        self._receiver = Receiver(
            self._cfg,
            self._rank,
            self._tp_size,
            transport,
            layout,
            compat,
            client=self._client,
            clock=self._clock,
            local_metadata=self._local_metadata,
            scratch=self._scratch,
        )
        # Layer-wise push writes straight from the KV cache: not through a staging pool.
        layers = layer_regions if self._staging is None and self._cfg.layerwise else None
        self._sender = Sender(
            self._cfg,
            transport,
            layout,
            compat,
            layers,
            clock=self._clock,
            epoch=self.epoch,
            rank=self._rank,
            tp_size=self._tp_size,
            words=self._words,
        )
        self._renewer = Renewer(self._cfg.engine_id, self._hash, self._client, self._cfg.handshake_timeout_s, self._clock)
        self._server = server  # last: the handler answers only once everything above exists
        logger.info(
            "KV cache registered: %d blocks x %d bytes in %d regions, %s, compat hash %s",
            layout.num_blocks,
            layout.block_bytes,
            len(layout.regions),
            layout.cells or "whole blocks only",
            self._hash,
        )

    def _register_words(self, transport: Transport, layout: KVLayout, kind: MemoryKind) -> None:
        """Lease words (kv_connectors.fence) beside a host KV cache moved directly: P's, and D's
        scratch they are read into. Not with a staging pool (it moves KV blocks only) or device
        memory (the words live in host memory, which one transfer cannot mix with the KV's)."""
        if not self._cfg.lease_words or self._staging is not None or kind is not MemoryKind.HOST:
            return
        words = LeaseWords(layout.num_blocks) if self._cfg.role.produces else None
        scratch = LeaseWords(layout.num_blocks) if self._cfg.role.consumes else None
        for w in (words, scratch):
            if w is not None:
                transport.register(w.layout, MemoryKind.HOST)
        self._words, self._scratch = words, scratch

    def _registered_transport(self, layout: KVLayout, kind: MemoryKind, device_id: int) -> Transport:
        """The transport with the KV cache registered: directly, or through a staging pool when
        asked (staging=on) or when device memory cannot be registered (staging=auto)."""
        name = f"{self._cfg.engine_id}-rank{self._rank}"
        if self._cfg.staging is Staging.ON:
            return self._staged(name, layout, kind, device_id)
        transport = self._make_transport(name)
        try:
            transport.register(layout, kind, device_id)
            return transport
        except TransportError as e:
            transport.close()
            if self._cfg.staging is not Staging.AUTO or kind is not MemoryKind.DEVICE:
                raise
            logger.warning(
                "device memory cannot be registered with the transport (%s): staging through a %d KiB host pool",
                e,
                self._cfg.staging_pool_kib,
            )
        return self._staged(name, layout, kind, device_id)

    def _staged(self, name: str, layout: KVLayout, kind: MemoryKind, device_id: int) -> Transport:
        inner = self._make_transport(name)
        try:
            staged = StagedTransport(
                inner,
                pool_bytes=self._cfg.staging_pool_kib * 1024,
                chunk_bytes=self._cfg.staging_chunk_kib * 1024,
            )
            staged.register(layout, kind, device_id)
        except BaseException:
            inner.close()
            raise
        self._staging = staged
        return staged

    def _handle_and_wake(self, body: wire.Body) -> wire.Body:
        """Side-channel requests (server thread); what the engine acts on ends its idle wait."""
        reply = self._handle(body)
        if not isinstance(body, wire.StatsRequest):
            self.pacer.wake()
        return reply

    def _handle(self, body: wire.Body) -> wire.Body:
        """Side-channel requests (server thread)."""
        if isinstance(body, wire.StatsRequest):
            return self._stats
        if self._server is None or self._transport is None or self._sender is None:
            return wire.ErrorReply(wire.ErrorCode.NOT_READY, "KV cache not registered yet")
        assert self._layout is not None and self._compat is not None
        admission = self._sender.admission
        if isinstance(body, wire.PushRequest):
            return admission.on_push(body)
        if isinstance(body, wire.AbortPush):
            return admission.on_abort(body)
        if isinstance(body, wire.ClaimRequest):
            return admission.on_claim(body)
        if isinstance(body, wire.RenewRequest):
            return admission.on_renew(body)
        if not isinstance(body, wire.HandshakeRequest):
            return wire.ErrorReply(wire.ErrorCode.BAD_REQUEST, f"unexpected {type(body).__name__}")
        why = tp_refusal(body, self._rank, self._tp_size, self._compat.num_kv_heads, self._layout)
        if why:
            logger.error("refused peer %s: %s", body.engine_id, why)
            return wire.ErrorReply(wire.ErrorCode.INCOMPATIBLE, why)
        if body.compat.hash() != self._hash:
            diff = self._compat.diff(body.compat, mine="server", theirs="client")
            logger.error("refused incompatible peer %s: %s", body.engine_id, diff)
            return wire.ErrorReply(wire.ErrorCode.INCOMPATIBLE, diff)
        logger.info("handshake from engine %s rank %d", body.engine_id, body.rank)
        self._sender.on_handshake(body)
        return wire.HandshakeReply(
            engine_id=self._cfg.engine_id,
            agent_name=self._transport.name,
            agent_metadata=self._local_metadata,
            layout=wire.LayoutMsg.from_layout(self._layout),
            epoch=self.epoch,
            rank=self._rank,
            tp_size=self._tp_size,
            lease_words=0 if self._words is None else self._words.base,
        )

    # per step ---------------------------------------------------------------------------------
    def start_load(self, meta: StepMetadata | None) -> None:
        if self._receiver is None or self._sender is None:
            return
        self._idle_step = meta is not None and meta.idle
        self._step_did_work = False
        if meta is not None and meta.has_work():
            self._ingest(meta)
            self._step_did_work = True
        if not self._skips_step():
            self._progress()
            self._step_did_work = True

    def _ingest(self, meta: StepMetadata) -> None:
        assert self._receiver is not None and self._sender is not None
        self._sender.add_leases(meta.reqs_to_send)
        for key, reason in meta.transfers_cancelled.items():
            self._sender.cancel(key, reason)
        # D's request may have come since before_forward: push right after this forward pass then.
        self._sender.begin_layerwise(meta.reqs_layerwise)
        assert self._renewer is not None
        for rid, (peer, key, p_tp) in meta.renew_start.items():
            try:
                subs = self._sources(rid, p_tp or self._known_tp(peer))
            except KVConnectorError:
                continue  # a TP combination that cannot be served: its load fails when scheduled
            self._renewing[rid] = [sub for sub, _ in subs]
            for sub, (p_rank, _) in subs:
                self._renewer.start(sub, self._rank_key(peer, p_rank), key)
        for rid in meta.renew_stop:
            for sub in self._renewing.pop(rid, [rid]):
                self._renewer.stop(sub)
        for rid, spec in meta.reqs_to_recv.items():
            p_tp = spec.remote_tp_size or self._known_tp(spec.peer_key)
            if p_tp is None and spec.report:
                self._ask_tp(spec.peer_key)
                self._deferred.append((rid, spec))
                continue
            self._add_load(rid, spec, p_tp)
        for rid, reason in meta.reqs_failed.items():
            self._fail_load(rid, FailReason.BAD_PARAMS, reason)

    def _fail_load(self, rid: str, reason: FailReason, message: str) -> None:
        """A load that fails before it reaches any producer: reported failed at the next results."""
        assert self._receiver is not None
        task = RecvTask(rid, RecvSpec(("", "", 0), "", (), ()), self._clock())
        task.fail(reason, message)
        self._receiver.add(task)

    def _known_tp(self, peer_key: tuple[str, str, int]) -> int | None:
        known = self._p_tp.get(peer_key[1:])
        return known[0] if known is not None and self._clock() - known[1] < _P_TP_TTL_S else None

    def _ask_tp(self, peer_key: tuple[str, str, int]) -> None:
        where = peer_key[1:]
        if where not in self._probes:
            timeout = self._cfg.handshake_timeout_s
            self._probes[where] = (self._client.submit(*where, wire.StatsRequest(), "", timeout), self._clock() + timeout)

    def _resolve_deferred(self) -> None:
        """Loads waiting for their P's TP size: planned once P's rank 0 said it, failed if it did not."""
        for where, (future, deadline) in list(self._probes.items()):
            if not future.done():
                if self._clock() > deadline:  # a frozen producer: its answer would come too late
                    future.cancel()
                    del self._probes[where]
                    logger.error("the producer at %s:%d did not say its tensor-parallel size in time", *where)
                continue
            del self._probes[where]
            try:
                reply = future.result()
                if not isinstance(reply, wire.StatsReply) or reply.tp_size < 1:
                    raise KVConnectorError(f"unexpected answer {type(reply).__name__}")
                self._p_tp[where] = (reply.tp_size, self._clock())
            except Exception as e:  # boundary: the loads waiting on it fail, never the step
                logger.error("could not ask the producer at %s:%d its tensor-parallel size: %s", *where, e)
        waiting, self._deferred = self._deferred, []
        for rid, spec in waiting:
            where = spec.peer_key[1:]
            if where in self._probes:
                self._deferred.append((rid, spec))
            elif (p_tp := self._known_tp(spec.peer_key)) is not None:
                self._add_load(rid, spec, p_tp)
            else:
                why = f"the producer at {where[0]}:{where[1]} did not say its tensor-parallel size"
                self._fail_load(rid, FailReason.HANDSHAKE, why)

    def _add_load(self, rid: str, spec: RecvSpec, p_tp: int | None) -> None:
        """One receive task per P rank holding this rank's heads."""
        assert self._receiver is not None
        now = self._clock()
        deadline = now + self._cfg.handshake_timeout_s + self._cfg.transfer_timeout_s
        try:
            sources = self._sources(rid, p_tp)
            if len(sources) > 1 or sources[0][1][1] != self._tp_size:
                self._check_heterogeneous(p_tp)
        except KVConnectorError as e:
            if spec.report:
                self._fail_load(rid, FailReason.BAD_PARAMS, str(e))
            else:  # a release (vLLM is done with the request): not a load, never reported
                _limited.warning("release", "request %s: cannot tell the producer to free its blocks: %s", rid, e)
            return
        for sub, (p_rank, src_tp) in sources:
            self._receiver.add(
                RecvTask(
                    request_id=sub,
                    spec=spec,
                    deadline=deadline,
                    kind=RecvKind.LOAD if spec.report else RecvKind.RELEASE,
                    peer=self._rank_key(spec.peer_key, p_rank),
                    remote_rank=p_rank,
                    remote_tp_size=src_tp,
                    group=rid if len(sources) > 1 else "",
                    started=now,
                    created=now,
                )
            )

    def _sources(self, rid: str, remote_tp_size: int | None) -> list[tuple[str, tuple[int, int]]]:
        """(task id, (P rank, P's TP size)) for each P rank this rank reads the request's heads from:
        P's rank of our number when P runs our TP size (or did not say), else those holding our heads."""
        p_tp = remote_tp_size or self._tp_size
        if p_tp == self._tp_size:
            return [(rid, (self._rank, p_tp))]
        assert self._compat is not None
        ranks = source_ranks(self._compat.num_kv_heads, p_tp, self._tp_size, self._rank)
        return [(rid if i == 0 else f"{rid}|p{p}", (p, p_tp)) for i, p in enumerate(ranks)]

    def _check_heterogeneous(self, p_tp: int | None) -> None:
        """Another TP size than P's: each D rank loads the heads of each P rank holding some of its
        own (reads them, or each such P rank writes them), where the layouts tell heads apart."""
        assert self._compat is not None and self._layout is not None
        where = f"prefill tensor_parallel_size {p_tp}, decode {self._tp_size}"
        if self._layout.cells is None:
            raise TransferParamsError(f"{where}: this instance's KV layout does not tell heads apart (only the same TP size)")
        try:
            reader_count(self._compat.num_kv_heads, p_tp or self._tp_size, self._tp_size, 0)
        except ConfigError as e:
            raise TransferParamsError(str(e)) from e

    @staticmethod
    def _rank_key(peer_key: tuple[str, str, int], p_rank: int) -> tuple[str, str, int]:
        """P rank p_rank's side channel: the params name P's rank 0; rank r listens at port + r."""
        engine, host, port = peer_key
        return (engine, host, port + p_rank)

    def _progress(self) -> None:
        """Advance both sides; notices meant for the sender (blocks D is done with) are kept
        until take_results."""
        assert self._receiver is not None and self._sender is not None and self._transport is not None
        self._last_progress = self._clock()
        if self._deferred or self._probes:
            self._resolve_deferred()
        self._sender.take_requests()  # connect consumers first: their messages may be in this batch
        for _agent, msg in self._transport.get_notifs():
            try:
                body = wire.decode(msg, self._hash)
            except KVConnectorError as e:
                _limited.warning("notif", "dropped a bad notification: %s", e)
                continue
            if not isinstance(body, wire.TransferDone):
                continue
            if not self._receiver.on_done_notice(body.request_id, body.error, body.runs, body.attempt):
                self._notices.append(body)
        self._receiver.progress()
        self._sender.progress()
        assert self._renewer is not None
        self._renewer.progress()

    def before_forward(self, meta: StepMetadata) -> None:
        """Layer-wise pushes for prefills the coming forward pass completes, where D already asked."""
        if self._sender is not None:
            self._sender.begin_layerwise(meta.reqs_layerwise)

    def on_layer_saved(self, layer_name: str) -> None:
        if self._sender is not None:
            self._sender.on_layer_saved(layer_name)

    def end_of_forward(self) -> None:
        if self._sender is not None:
            self._sender.end_layerwise()

    # results ----------------------------------------------------------------------------------
    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.

        At the end of a step that scheduled no token and finished nothing, waits briefly for the
        next event (kv_connectors.idle) and looks again, instead of returning to vLLM's next empty
        step at once. A step with nothing held or under way returns at once (_skips_step)."""
        if self._receiver is None or self._sender is None:
            return set(), set(), set()
        idle, self._idle_step = self._idle_step, False
        did_work, self._step_did_work = self._step_did_work, True
        if not idle and not did_work and self._skips_step():
            return set(), set(), set()  # nothing changed: the counters' snapshot still holds
        self._idle_steps += idle
        self.pacer.arm()  # before looking: a reply arriving from now on ends the wait
        results = self._collect()
        if idle and not any(results) and self.pacer.enabled:
            self._pause()
            results = self._collect()
        if not idle or any(results):
            self.pacer.reset()
        return results

    def _skips_step(self) -> bool:
        """Nothing held or under way (a decode step, most often): the step's work is skipped, the
        counters stay as they are, except every QUIET_POLL_S (the transport's queue is drained)."""
        assert self._receiver is not None and self._sender is not None and self._renewer is not None
        busy = (
            self._receiver.busy()
            or self._sender.busy()
            or self._renewer.busy()
            or self._deferred
            or self._probes
            or self._notices
            or (self._staging is not None and self._staging.busy())
        )
        return not busy and self._clock() - self._last_progress < QUIET_POLL_S

    def _collect(self) -> tuple[set[str], set[str], set[str]]:
        assert self._receiver is not None and self._sender is not None
        self._progress()
        notices, self._notices = self._notices, []
        sending = self._sender.take_finished(notices)
        recving, failed = self._receiver.take_finished()
        self._stats = self._snapshot()
        return sending, recving, failed

    def _pause(self) -> None:
        """An empty step's wait: none while staging moves chunks (each round trip is polled), brief
        while something only polling sees is awaited, else up to the configured cap (what remains
        comes with a side-channel message or answer, which ends the wait), the whole cap at once
        while such an answer is on its way."""
        assert self._receiver is not None and self._sender is not None
        if self._staging is not None and self._staging.busy():
            return
        awaiting = self._receiver.awaiting() or bool(self._probes)
        cap = POLL_WAIT_S if self._receiver.polling() or self._sender.polling() else float("inf")
        self.pacer.pause(cap, awaiting)

    @property
    def stats(self) -> wire.StatsReply:
        """Counters as of the last take_results (what the side channel answers to StatsRequest)."""
        return self._stats

    def take_load_durations(self) -> list[float]:
        """Each completed load's duration since the last call (for the load-time histogram)."""
        if self._receiver is None:
            return []
        durations, self._receiver.totals.durations = self._receiver.totals.durations, []
        return durations

    def take_phase_durations(self) -> dict[Phase, list[float]]:
        """Each phase's durations since the last call (kv_connectors.counters.Phase), for histograms."""
        if self._receiver is None or self._sender is None:
            return {}
        phases, self._receiver.totals.phases = self._receiver.totals.phases, {}
        holds = self._sender.leases.take_hold_seconds()
        if holds:
            phases[Phase.LEASE_HOLD] = holds
        return phases

    def _snapshot(self) -> wire.StatsReply:
        assert self._receiver is not None and self._sender is not None
        t, leases = self._receiver.totals, self._sender.leases
        settling, quarantined, quarantined_bytes = self._receiver.settling()
        return wire.StatsReply(
            engine_id=self._cfg.engine_id,
            rank=self._rank,
            tp_size=self._tp_size,
            held_requests=leases.held_requests,
            held_blocks=leases.held_blocks,
            completed_sends=leases.completed,
            expired_leases=leases.expired,
            recv_transfers=t.transfers,
            recv_failures=t.failures,
            recv_bytes=t.bytes,
            recv_blocks=t.blocks,
            recv_descriptors=t.descriptors,
            recv_seconds=t.seconds,
            pushes=self._sender.pushes,
            layerwise_pushes=self._sender.layerwise_pushes,
            push_failures=self._sender.push_failures,
            claims_granted=leases.claims_granted,
            claims_refused=leases.claims_refused,
            stale_reads_refused=self._receiver.claims_refused,
            reads_fenced_by_words=self._receiver.fenced_by_words,
            lease_renewals=self._renewer.renewals if self._renewer is not None else 0,
            idle_steps=self._idle_steps,
            settled_loads=t.settled,
            settling_loads=settling,
            quarantined_loads=quarantined,
            quarantined_bytes=quarantined_bytes,
            **self._staging_stats(),
        )

    def _staging_stats(self) -> dict[str, int]:
        if self._staging is None:
            return {}
        ps = self._staging.pool_stats()
        return {
            "staging_pool_bytes": int(ps["pool_bytes"]),
            "staging_peak_bytes": int(ps["peak_slots_in_use"]) * self._cfg.staging_chunk_kib * 1024,
            "staging_allocated_bytes": int(ps.get("allocated_bytes", ps["pool_bytes"])),
        }

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._receiver is not None:
            self._receiver.close()
        if self._sender is not None:
            self._sender.close()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
