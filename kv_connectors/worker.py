"""Worker side of the engine: the step loop over the parts kv_connectors.assembly builds (transport,
side-channel server, D's and P's wings); results and counters for vLLM.

Pure (no vLLM import): the clock, the side channel (server factory and client) and the transport
factory are injected, so every path runs in unit tests over the memory transport with a fake clock.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from kv_connectors import sidechannel, snapshot, wire
from kv_connectors.assembly import Parts, ServerFactory, TransportFactory, Where, assemble
from kv_connectors.config import ConnectorConfig
from kv_connectors.counters import Phase
from kv_connectors.errors import KVConnectorError
from kv_connectors.idle import IdlePacer
from kv_connectors.layout import KVLayout
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.producer.admission import Desk
from kv_connectors.producer.sender import Ready
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


class StepLoop:
    """The step loop over a registered worker's parts (ingest the scheduler's metadata, progress both
    wings, route notifications, idle pacing, results)."""

    def __init__(self, parts: Parts, where: Where, desk: Desk, pacer: IdlePacer, clock: Callable[[], float]) -> None:
        self.parts = parts
        self._where, self._desk, self._pacer, self._clock = where, desk, pacer, clock
        self._idle_step = False  # the current step schedules no token (from the scheduler side)
        self._idle_steps = 0
        self._last_progress = float("-inf")  # when the engine last advanced (_skips_step)
        self._step_did_work = True  # this step's start_load ingested or advanced something
        self._notices: list[wire.TransferDone] = []  # for the sender, collected between results

    def start_load(self, meta: StepMetadata | None) -> None:
        self._idle_step = meta is not None and meta.idle
        self._step_did_work = False
        if meta is not None and meta.has_work():
            self._ingest(meta)
            self._step_did_work = True
        if not self._skips_step():
            self._progress()
            self._step_did_work = True

    def _ingest(self, meta: StepMetadata) -> None:
        sender = self.parts.sender
        sender.add_leases(meta.reqs_to_send)
        for key, reason in meta.transfers_cancelled.items():
            sender.cancel(key, reason)
        # D's request may have come since before_forward: push right after this forward pass then.
        sender.begin_layerwise(meta.reqs_layerwise)
        self.parts.ranks.take(meta)

    def _progress(self) -> None:
        """Advance both sides; notices meant for the sender (blocks D is done with) are kept
        until take_results."""
        parts = self.parts
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
        self.parts.sender.begin_layerwise(meta.reqs_layerwise)

    def on_layer_saved(self, layer_name: str, ready: Ready | None) -> None:
        self.parts.sender.on_layer_saved(layer_name, ready)

    def end_of_forward(self, ready: Ready | None) -> None:
        self.parts.sender.end_layerwise(ready)

    def writes_layers(self) -> bool:
        return self.parts.sender.writes_layers()

    def take_load_durations(self) -> list[float]:
        return snapshot.take_load_durations(self.parts)

    def take_phase_durations(self) -> dict[Phase, list[float]]:
        return snapshot.take_phase_durations(self.parts)

    def close(self) -> None:
        self.parts.close()

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        idle, self._idle_step = self._idle_step, False
        did_work, self._step_did_work = self._step_did_work, True
        if not idle and not did_work and self._skips_step():
            return set(), set(), set()  # nothing changed: the counters' snapshot still holds
        self._idle_steps += idle
        self._pacer.arm()  # before looking: a reply arriving from now on ends the wait
        results = self._collect()
        if idle and not any(results) and self._pacer.enabled:
            self._pause()
            results = self._collect()
        if not idle or any(results):
            self._pacer.reset()
        return results

    def _skips_step(self) -> bool:
        """Nothing held or under way (a decode step, most often): the step's work is skipped, the
        counters stay as they are, except every QUIET_POLL_S (the transport's queue is drained)."""
        busy = self.parts.busy() or self._notices
        return not busy and self._clock() - self._last_progress < QUIET_POLL_S

    def _collect(self) -> tuple[set[str], set[str], set[str]]:
        parts = self.parts
        self._progress()
        notices, self._notices = self._notices, []
        sending = parts.sender.take_finished(notices)
        recving, failed = parts.receiver.take_finished()
        parts.ranks.ended(recving, failed)
        self._desk.stats = snapshot.snapshot(self._where, parts, self._idle_steps, self._desk.ranks)
        return sending, recving, failed

    def _pause(self) -> None:
        """An empty step's wait: none while staging moves chunks (each round trip is polled), brief
        while something only polling sees is awaited, else up to the configured cap (what remains
        comes with a side-channel message or answer, which ends the wait), the whole cap at once
        while such an answer is on its way."""
        parts = self.parts
        if parts.staging is not None and parts.staging.busy():
            return
        awaiting = parts.receiver.awaiting() or parts.ranks.awaiting()
        cap = POLL_WAIT_S if parts.receiver.polling() or parts.sender.polling() else float("inf")
        self._pacer.pause(cap, awaiting)


class _Unregistered:
    """The step loop's stand-in before register() and after close(): every hook is a no-op."""

    @property
    def parts(self) -> Parts:
        raise KVConnectorError("the KV cache is not registered yet")

    def start_load(self, meta: StepMetadata | None) -> None: ...

    def before_forward(self, meta: StepMetadata) -> None: ...

    def on_layer_saved(self, layer_name: str, ready: Ready | None) -> None: ...

    def end_of_forward(self, ready: Ready | None) -> None: ...

    def writes_layers(self) -> bool:
        return False

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        return set(), set(), set()

    def take_load_durations(self) -> list[float]:
        return []

    def take_phase_durations(self) -> dict[Phase, list[float]]:
        return {}

    def close(self) -> None: ...


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
        self.pacer = IdlePacer(cfg.idle_wait_ms / 1000.0, idle_wait)
        inner = client or sidechannel.SideChannelClient(secret=cfg.side_channel_secret)
        self._desk = Desk(wire.StatsReply(engine_id=cfg.engine_id, rank=rank, tp_size=tp_size), self.pacer.wake)
        self._clock = clock
        self._assemble = functools.partial(
            assemble,
            self._where,
            make_transport=make_transport,
            transport_label=transport_label,
            serve=serve,
            handler=self._desk.answer,
            client=sidechannel.WakingClient(inner, self.pacer.wake),
            clock=clock,
        )
        self._loop: StepLoop | _Unregistered = _Unregistered()

    @property
    def rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self._where.rank

    @property
    def parts(self) -> Parts:
        """The registered worker's parts (KVConnectorError before register)."""
        return self._loop.parts

    # set-up ---------------------------------------------------------------------------------
    def register(
        self,
        layout: KVLayout,
        compat: wire.CompatInfo,
        kind: MemoryKind = MemoryKind.HOST,
        device_id: int = 0,
        layer_regions: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        parts = self._assemble(layout, compat, kind=kind, device_id=device_id, layer_regions=layer_regions)
        self._loop = StepLoop(parts, self._where, self._desk, self.pacer, self._clock)
        self._desk.admission = parts.sender.admission

    @property
    def address(self) -> str:
        """Where peers reach this rank's side channel ("host:port"; KVConnectorError before register)."""
        return self.parts.address

    def set_directory(self, addresses: Sequence[str]) -> None:
        """Every rank's side-channel address, by rank (the adapter gathers them over the TP group once
        registered): rank 0 names the others to a peer that asks (config.PortLayout)."""
        self._desk.set_ranks(addresses, self.address)

    # per step ---------------------------------------------------------------------------------
    def start_load(self, meta: StepMetadata | None) -> None:
        self._loop.start_load(meta)

    def before_forward(self, meta: StepMetadata) -> None:
        """Layer-wise pushes for prefills the coming forward pass completes, where D already asked."""
        self._loop.before_forward(meta)

    def on_layer_saved(self, layer_name: str, ready: Ready | None = None) -> None:
        """A layer's attention returned; ready: the device ran the kernels filling its KV (None: it did)."""
        self._loop.on_layer_saved(layer_name, ready)

    def end_of_forward(self, ready: Ready | None = None) -> None:
        """The forward pass returned; ready: the device ran its kernels (None: it did)."""
        self._loop.end_of_forward(ready)

    def writes_layers(self) -> bool:
        """A layer-wise push follows this forward pass (the adapter records device signals only then)."""
        return self._loop.writes_layers()

    # results ----------------------------------------------------------------------------------
    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.

        At the end of a step that scheduled no token and finished nothing, waits briefly for the
        next event (kv_connectors.idle) and looks again, instead of returning to vLLM's next empty
        step at once. A step with nothing held or under way returns at once (_skips_step)."""
        return self._loop.take_results()

    @property
    def stats(self) -> wire.StatsReply:
        """Counters as of the last take_results (what the side channel answers to StatsRequest)."""
        return self._desk.stats

    def take_load_durations(self) -> list[float]:
        """Each completed load's duration since the last call (for the load-time histogram)."""
        return self._loop.take_load_durations()

    def take_phase_durations(self) -> dict[Phase, list[float]]:
        """Each phase's durations since the last call (kv_connectors.counters.Phase), for histograms."""
        return self._loop.take_phase_durations()

    def close(self) -> None:
        loop, self._loop = self._loop, _Unregistered()
        loop.close()
