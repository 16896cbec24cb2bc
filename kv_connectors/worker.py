"""Worker side of the engine: the step loop over the parts kv_connectors.assembly builds (transport,
side-channel server, D's and P's wings); results and counters for vLLM.

Pure (no vLLM import): the clock, the side channel (server factory and client) and the transport
factory are injected, so every path runs in unit tests over the memory transport with a fake clock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import msgspec

from kv_connectors import sidechannel, wire
from kv_connectors.assembly import Parts, ServerFactory, TransportFactory, Where, assemble
from kv_connectors.config import ConnectorConfig
from kv_connectors.counters import Phase
from kv_connectors.errors import KVConnectorError
from kv_connectors.idle import IdlePacer
from kv_connectors.layout import KVLayout
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.producer.sender import Ready
from kv_connectors.snapshot import snapshot
from kv_connectors.specs import StepMetadata
from kv_connectors.transports.base import MemoryKind

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)
# The longest wait after an empty step while a transfer is in flight (its completion is polled).
POLL_WAIT_S = 0.0005
# With nothing held or under way (plain decoding), steps skip the engine's work but for this often:
# the transport's notifications a peer may still send are drained then (bounded, never lost).
QUIET_POLL_S = 0.05

__all__ = ["POLL_WAIT_S", "QUIET_POLL_S", "ServerFactory", "TransportFactory", "WorkerEngine"]


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
    there); the side-channel thread only answers handshakes, claims, renewals, aborts and stats and
    queues push requests. Until register() (vLLM registers the KV cache) every step is a no-op."""

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
        dp_index: int = 0,
        idle_wait: Callable[[float], bool] | None = None,
    ) -> None:
        """idle_wait: the blocking wait of an empty step (kv_connectors.idle; tests record it).
        dp_index: the data-parallel index of this worker's engine (its side-channel ports)."""
        self._cfg = cfg
        cfg.check_ports(dp_index, tp_size)
        self.epoch = uuid.uuid4().hex[:16]  # this start of the engine: peers tell restarts apart by it
        self._where = Where(cfg, rank, tp_size, self.epoch, dp_index)
        self._serve = serve
        self._make_transport = make_transport
        self._transport_label = transport_label
        self.pacer = IdlePacer(cfg.idle_wait_ms / 1000.0, idle_wait)
        inner = client or sidechannel.SideChannelClient(secret=cfg.side_channel_secret)
        self._client: sidechannel.Client = _WakingClient(inner, self.pacer.wake)
        self._clock = clock
        self._parts: Parts | None = None
        self._idle_step = False  # the current step schedules no token (from the scheduler side)
        self._idle_steps = 0
        self._last_progress = float("-inf")  # when the engine last advanced (_skips_step)
        self._step_did_work = True  # this step's start_load ingested or advanced something
        self._stats = wire.StatsReply(engine_id=cfg.engine_id, rank=rank, tp_size=tp_size)
        self._directory: tuple[str, ...] = ()  # every rank's side-channel address (set_directory)
        self._notices: list[wire.TransferDone] = []  # for the sender, collected between results

    @property
    def rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self._where.rank

    @property
    def parts(self) -> Parts:
        """The registered worker's parts (KVConnectorError before register)."""
        if self._parts is None:
            raise KVConnectorError("the KV cache is not registered yet")
        return self._parts

    # set-up ---------------------------------------------------------------------------------
    def register(
        self,
        layout: KVLayout,
        compat: wire.CompatInfo,
        kind: MemoryKind = MemoryKind.HOST,
        device_id: int = 0,
        layer_regions: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self._parts = assemble(
            self._where,
            layout,
            compat,
            kind=kind,
            device_id=device_id,
            layer_regions=layer_regions,
            make_transport=self._make_transport,
            transport_label=self._transport_label,
            serve=self._serve,
            handler=self._handle_and_wake,
            client=self._client,
            clock=self._clock,
        )

    @property
    def address(self) -> str:
        """Where peers reach this rank's side channel ("host:port"; KVConnectorError before register)."""
        return self.parts.address

    def set_directory(self, addresses: Sequence[str]) -> None:
        """Every rank's side-channel address, by rank (the adapter gathers them over the TP group once
        registered): rank 0 names the others to a peer that asks (config.PortLayout)."""
        if len(addresses) != self._where.tp_size or addresses[self.rank] != self.address:
            raise KVConnectorError(f"rank {self.rank} of {self._where.tp_size} was given side channels {list(addresses)}")
        self._directory = tuple(addresses)
        self._stats = msgspec.structs.replace(self._stats, ranks=self._directory)

    def _handle_and_wake(self, body: wire.Body) -> wire.Body:
        """Side-channel requests (server thread); what the engine acts on ends its idle wait."""
        reply = self._handle(body)
        if not isinstance(body, wire.StatsRequest):
            self.pacer.wake()
        return reply

    def _handle(self, body: wire.Body) -> wire.Body:
        """Side-channel requests (server thread): stats here, the rest is P's admission's."""
        if isinstance(body, wire.StatsRequest):
            return self._stats
        parts = self._parts  # set once every part exists: until then, not ready
        if parts is None:
            return wire.ErrorReply(wire.ErrorCode.NOT_READY, "KV cache not registered yet")
        return parts.sender.admission.handle(body)

    # per step ---------------------------------------------------------------------------------
    def start_load(self, meta: StepMetadata | None) -> None:
        parts = self._parts
        if parts is None:
            return
        self._idle_step = meta is not None and meta.idle
        self._step_did_work = False
        if meta is not None and meta.has_work():
            self._ingest(parts, meta)
            self._step_did_work = True
        if not self._skips_step(parts):
            self._progress(parts)
            self._step_did_work = True

    @staticmethod
    def _ingest(parts: Parts, meta: StepMetadata) -> None:
        sender = parts.sender
        sender.add_leases(meta.reqs_to_send)
        for key, reason in meta.transfers_cancelled.items():
            sender.cancel(key, reason)
        # D's request may have come since before_forward: push right after this forward pass then.
        sender.begin_layerwise(meta.reqs_layerwise)
        parts.ranks.take(meta)

    def _progress(self, parts: Parts) -> None:
        """Advance both sides; notices meant for the sender (blocks D is done with) are kept
        until take_results."""
        self._last_progress = self._clock()
        parts.ranks.resolve()
        parts.sender.take_requests()  # connect consumers first: their messages may be in this batch
        for _agent, msg in parts.transport.get_notifs():
            try:
                body = wire.decode(msg, parts.hash)
            except KVConnectorError as e:
                _limited.warning("notif", "dropped a bad notification: %s", e)
                continue
            if not isinstance(body, wire.TransferDone):
                continue
            if not parts.receiver.on_done_notice(body.request_id, body.error, body.runs, body.attempt):
                self._notices.append(body)
        parts.receiver.progress()
        parts.sender.progress()
        parts.renewer.progress()

    def before_forward(self, meta: StepMetadata) -> None:
        """Layer-wise pushes for prefills the coming forward pass completes, where D already asked."""
        if self._parts is not None:
            self._parts.sender.begin_layerwise(meta.reqs_layerwise)

    def on_layer_saved(self, layer_name: str, ready: Ready | None = None) -> None:
        """A layer's attention returned; ready: the device ran the kernels filling its KV (None: it did)."""
        if self._parts is not None:
            self._parts.sender.on_layer_saved(layer_name, ready)

    def end_of_forward(self, ready: Ready | None = None) -> None:
        """The forward pass returned; ready: the device ran its kernels (None: it did)."""
        if self._parts is not None:
            self._parts.sender.end_layerwise(ready)

    def writes_layers(self) -> bool:
        """A layer-wise push follows this forward pass (the adapter records device signals only then)."""
        return self._parts is not None and self._parts.sender.writes_layers()

    # results ----------------------------------------------------------------------------------
    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.

        At the end of a step that scheduled no token and finished nothing, waits briefly for the
        next event (kv_connectors.idle) and looks again, instead of returning to vLLM's next empty
        step at once. A step with nothing held or under way returns at once (_skips_step)."""
        parts = self._parts
        if parts is None:
            return set(), set(), set()
        idle, self._idle_step = self._idle_step, False
        did_work, self._step_did_work = self._step_did_work, True
        if not idle and not did_work and self._skips_step(parts):
            return set(), set(), set()  # nothing changed: the counters' snapshot still holds
        self._idle_steps += idle
        self.pacer.arm()  # before looking: a reply arriving from now on ends the wait
        results = self._collect(parts)
        if idle and not any(results) and self.pacer.enabled:
            self._pause(parts)
            results = self._collect(parts)
        if not idle or any(results):
            self.pacer.reset()
        return results

    def _skips_step(self, parts: Parts) -> bool:
        """Nothing held or under way (a decode step, most often): the step's work is skipped, the
        counters stay as they are, except every QUIET_POLL_S (the transport's queue is drained)."""
        busy = (
            parts.receiver.busy()
            or parts.sender.busy()
            or parts.renewer.busy()
            or parts.ranks.busy()
            or self._notices
            or (parts.staging is not None and parts.staging.busy())
        )
        return not busy and self._clock() - self._last_progress < QUIET_POLL_S

    def _collect(self, parts: Parts) -> tuple[set[str], set[str], set[str]]:
        self._progress(parts)
        notices, self._notices = self._notices, []
        sending = parts.sender.take_finished(notices)
        recving, failed = parts.receiver.take_finished()
        parts.ranks.ended(recving, failed)
        self._stats = snapshot(self._where, parts, self._idle_steps, self._directory)
        return sending, recving, failed

    def _pause(self, parts: Parts) -> None:
        """An empty step's wait: none while staging moves chunks (each round trip is polled), brief
        while something only polling sees is awaited, else up to the configured cap (what remains
        comes with a side-channel message or answer, which ends the wait), the whole cap at once
        while such an answer is on its way."""
        if parts.staging is not None and parts.staging.busy():
            return
        awaiting = parts.receiver.awaiting() or parts.ranks.awaiting()
        cap = POLL_WAIT_S if parts.receiver.polling() or parts.sender.polling() else float("inf")
        self.pacer.pause(cap, awaiting)

    @property
    def stats(self) -> wire.StatsReply:
        """Counters as of the last take_results (what the side channel answers to StatsRequest)."""
        return self._stats

    def take_load_durations(self) -> list[float]:
        """Each completed load's duration since the last call (for the load-time histogram)."""
        if self._parts is None:
            return []
        totals = self._parts.receiver.totals
        durations, totals.durations = totals.durations, []
        return durations

    def take_phase_durations(self) -> dict[Phase, list[float]]:
        """Each phase's durations since the last call (kv_connectors.counters.Phase), for histograms."""
        if self._parts is None:
            return {}
        totals = self._parts.receiver.totals
        phases, totals.phases = totals.phases, {}
        holds = self._parts.sender.leases.take_hold_seconds()
        if holds:
            phases[Phase.LEASE_HOLD] = holds
        return phases

    def close(self) -> None:
        parts, self._parts = self._parts, None
        if parts is None:
            return
        parts.server.close()
        parts.receiver.close()
        parts.sender.close()
        parts.transport.close()
