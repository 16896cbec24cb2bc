"""D's tensor-parallel fan-out: which producer ranks a load reads (or a heartbeat renews) on this
decode rank, asking P its TP size where the params do not state it (the transfer-id flow)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.consumer.receiver import Receiver
from kv_connectors.consumer.renewer import Renewer
from kv_connectors.consumer.tasks import FailReason, RecvKind, RecvTask
from kv_connectors.errors import KVConnectorError, PeerProtocolError, TransferParamsError
from kv_connectors.layout import KVLayout
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.specs import ProducerAddress, RecvSpec, StepMetadata
from kv_connectors.tp import check_pairing, rank_sources

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)
# How long what a producer said of its ranks (asked once) is trusted: a restart may change its TP
# size and the ports its ranks > 0 listen on (a failed load of it forgets them sooner).
_P_RANKS_TTL_S = 60.0
_Where = tuple[str, int]  # a producer instance's side channel: its rank 0's (host, port)


def rank_key(peer_key: ProducerAddress, p_rank: int) -> ProducerAddress:
    """P rank p_rank's side channel where P did not name its ranks (an older version): port + r."""
    return peer_key._replace(port=peer_key.port + p_rank)


@dataclasses.dataclass(frozen=True)
class ProducerRanks:
    """What a producer instance's rank 0 said of its ranks (a StatsReply), checked."""

    tp_size: int
    addresses: tuple[tuple[str, int], ...]  # each rank's side channel; (): rank r at port + r
    asked_at: float

    @classmethod
    def of(cls, reply: wire.Body, now: float) -> ProducerRanks:
        if not isinstance(reply, wire.StatsReply) or reply.tp_size < 1:
            raise PeerProtocolError(f"unexpected answer {type(reply).__name__}")
        if reply.ranks and len(reply.ranks) != reply.tp_size:
            raise PeerProtocolError(f"it named {len(reply.ranks)} side channels for {reply.tp_size} ranks")
        return cls(reply.tp_size, tuple(sidechannel.parse_address(a) for a in reply.ranks), now)

    def key(self, peer_key: ProducerAddress, p_rank: int) -> ProducerAddress:
        if p_rank == 0 or not self.addresses:
            return rank_key(peer_key, p_rank)
        if p_rank >= len(self.addresses):
            raise TransferParamsError(f"the producer at {peer_key.host}:{peer_key.port} has no rank {p_rank}")
        return ProducerAddress(peer_key.engine_id, *self.addresses[p_rank])


class Ranks:
    """Turns the scheduler's loads, releases and heartbeats into tasks per producer rank. A
    producer's rank 0 is at the address its params name; where a load reads other ranks (or P's TP
    size is not stated: the transfer-id flow), rank 0 is asked first where they are (config.PortLayout)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        tp_size: int,
        num_kv_heads: int,
        layout: KVLayout,
        *,
        receiver: Receiver,
        renewer: Renewer,
        client: sidechannel.Client,
        clock: Callable[[], float],
    ) -> None:
        self._cfg = cfg
        self._rank, self._tp_size, self._heads = rank, tp_size, num_kv_heads
        self._layout = layout
        self._receiver = receiver
        self._renewer = renewer
        self._client = client
        self._clock = clock
        self._renewing: dict[str, list[str]] = {}  # request id -> its renewals (one per P rank read)
        self._known: dict[_Where, ProducerRanks] = {}
        self._probes: dict[_Where, tuple[concurrent.futures.Future[wire.Body], float]] = {}  # and deadline
        self._deferred: list[tuple[str, RecvSpec]] = []  # loads waiting for their P's ranks
        self._deferred_renewals: list[tuple[str, tuple[ProducerAddress, str, int | None]]] = []
        self._loads: dict[str, _Where] = {}  # load -> its producer: a failed one forgets what P said

    def busy(self) -> bool:
        return bool(self._deferred or self._deferred_renewals or self._probes)

    def awaiting(self) -> bool:
        """A producer's ranks are being asked (its answer wakes the engine)."""
        return bool(self._probes)

    def take(self, meta: StepMetadata) -> None:
        """The step's heartbeats, loads and releases, and the loads the scheduler failed."""
        for rid, renewal in meta.renew_start.items():
            self._start_renewals(rid, renewal)
        for rid in meta.renew_stop:
            self._deferred_renewals = [(r, renewal) for r, renewal in self._deferred_renewals if r != rid]
            for sub in self._renewing.pop(rid, [rid]):
                self._renewer.stop(sub)
        for rid, spec in meta.reqs_to_recv.items():
            if self._needs_asking(spec.peer_key, spec.remote_tp_size, must_know_tp=spec.report):
                self._deferred.append((rid, spec))
            else:
                self._add_load(rid, spec, spec.remote_tp_size or self._known_tp(spec.peer_key))
        for rid, reason in meta.reqs_failed.items():
            self._fail_load(rid, FailReason.BAD_PARAMS, reason)

    def ended(self, finished: set[str], failed: set[str]) -> None:
        """Loads reported to vLLM: what a failed one's producer said of its ranks is asked again
        (it may have restarted, its ranks > 0 on other ports)."""
        for rid in finished | failed:
            where = self._loads.pop(rid, None)
            if where is not None and rid in failed:
                self._known.pop(where, None)

    def _start_renewals(self, rid: str, renewal: tuple[ProducerAddress, str, int | None], *, asked: bool = False) -> None:
        peer, key, p_tp = renewal
        if not asked and self._needs_asking(peer, p_tp, must_know_tp=False):
            self._deferred_renewals.append((rid, renewal))
            return
        try:
            subs = self._sources(rid, p_tp or self._known_tp(peer))
            keys = [(sub, self._key(peer, p_rank)) for sub, (p_rank, _) in subs]
        except KVConnectorError:
            return  # a TP combination that cannot be served (its load fails when scheduled), or P unknown
        self._renewing[rid] = [sub for sub, _ in keys]
        for sub, producer in keys:
            self._renewer.start(sub, producer, key)

    def _fail_load(self, rid: str, reason: FailReason, message: str) -> None:
        """A load that fails before it reaches any producer: reported failed at the next results."""
        task = RecvTask(rid, RecvSpec(ProducerAddress("", "", 0), "", (), ()), self._clock())
        task.fail(reason, message)
        self._receiver.add(task)

    def _fresh(self, peer_key: ProducerAddress) -> ProducerRanks | None:
        known = self._known.get(peer_key.where)
        return known if known is not None and self._clock() - known.asked_at < _P_RANKS_TTL_S else None

    def _known_tp(self, peer_key: ProducerAddress) -> int | None:
        known = self._fresh(peer_key)
        return known.tp_size if known is not None else None

    def _key(self, peer_key: ProducerAddress, p_rank: int) -> ProducerAddress:
        """P rank p_rank's side channel (KVConnectorError where P has not said where it is)."""
        if p_rank == 0:
            return peer_key
        known = self._fresh(peer_key)
        if known is None:
            raise PeerProtocolError(f"the producer at {peer_key.host}:{peer_key.port} did not say where its rank {p_rank} is")
        return known.key(peer_key, p_rank)

    def _needs_asking(self, peer_key: ProducerAddress, p_tp: int | None, *, must_know_tp: bool) -> bool:
        """P's rank 0 must first say its TP size (where not stated and a load needs it) or where
        the ranks this rank reads are: asked (once at a time) where so."""
        if self._fresh(peer_key) is not None:
            return False
        tp = p_tp or self._tp_size
        if (p_tp is None and must_know_tp) or self._reads_beyond_rank0(tp):
            self._ask(peer_key)
            return True
        return False

    def _reads_beyond_rank0(self, p_tp: int) -> bool:
        try:
            return any(p_rank != 0 for _, (p_rank, _) in self._sources("", p_tp))
        except KVConnectorError:
            return False  # refused when the load is added

    def _ask(self, peer_key: ProducerAddress) -> None:
        where = peer_key.where
        if where not in self._probes:
            timeout = self._cfg.handshake_timeout_s
            self._probes[where] = (self._client.submit(*where, wire.StatsRequest(), "", timeout), self._clock() + timeout)

    def resolve(self) -> None:
        """Loads and heartbeats waiting for their P's ranks: added once P's rank 0 said them, failed if it did not."""
        if not self.busy():
            return
        for where, (future, deadline) in list(self._probes.items()):
            if not future.done():
                if self._clock() > deadline:  # a frozen producer: its answer would come too late
                    future.cancel()
                    del self._probes[where]
                    logger.error("the producer at %s:%d did not say its tensor-parallel ranks in time", *where)
                continue
            del self._probes[where]
            try:
                self._known[where] = ProducerRanks.of(future.result(), self._clock())
            except Exception as e:  # boundary: the loads waiting on it fail, never the step
                logger.error("could not ask the producer at %s:%d its tensor-parallel ranks: %s", *where, e)
        waiting, self._deferred = self._deferred, []
        for rid, spec in waiting:
            where = spec.peer_key.where
            if where in self._probes:
                self._deferred.append((rid, spec))
            elif (known := self._fresh(spec.peer_key)) is not None:
                self._add_load(rid, spec, spec.remote_tp_size or known.tp_size)
            elif spec.report:
                why = f"the producer at {where[0]}:{where[1]} did not say its tensor-parallel ranks"
                self._fail_load(rid, FailReason.HANDSHAKE, why)
            else:
                _limited.warning("release", "request %s: the producer at %s:%d did not say where its ranks are", rid, *where)
        renewals, self._deferred_renewals = self._deferred_renewals, []
        for rid, renewal in renewals:
            if renewal[0][1:] in self._probes:
                self._deferred_renewals.append((rid, renewal))
            else:
                self._start_renewals(rid, renewal, asked=True)

    def _add_load(self, rid: str, spec: RecvSpec, p_tp: int | None) -> None:
        """One receive task per P rank holding this rank's heads."""
        now = self._clock()
        deadline = now + self._cfg.handshake_timeout_s + self._cfg.transfer_timeout_s
        try:
            sources = self._sources(rid, p_tp)
            if len(sources) > 1 or sources[0][1][1] != self._tp_size:
                check_pairing(self._heads, sources[0][1][1], self._tp_size, tells_heads=self._layout.cells is not None)
            peers = [self._key(spec.peer_key, p_rank) for _, (p_rank, _) in sources]
        except KVConnectorError as e:
            if spec.report:
                self._fail_load(rid, FailReason.BAD_PARAMS, str(e))
            else:  # a release (vLLM is done with the request): not a load, never reported
                _limited.warning("release", "request %s: cannot tell the producer to free its blocks: %s", rid, e)
            return
        if spec.report:
            self._loads[rid] = spec.peer_key.where
        for (sub, (p_rank, src_tp)), peer in zip(sources, peers):
            self._receiver.add(
                RecvTask(
                    request_id=sub,
                    spec=spec,
                    deadline=deadline,
                    kind=RecvKind.LOAD if spec.report else RecvKind.RELEASE,
                    peer=peer,
                    remote_rank=p_rank,
                    remote_tp_size=src_tp,
                    group=rid if len(sources) > 1 else "",
                    started=now,
                    created=now,
                )
            )

    def _sources(self, rid: str, remote_tp_size: int | None) -> list[tuple[str, tuple[int, int]]]:
        """(task id, (P rank, P's TP size)) for each P rank this rank reads the request's heads from
        (kv_connectors.tp.rank_sources; P's TP size not stated: ours)."""
        p_tp = remote_tp_size or self._tp_size
        ranks = rank_sources(self._heads, p_tp, self._tp_size, self._rank)
        return [(rid if i == 0 else f"{rid}|p{p}", (p, p_tp)) for i, p in enumerate(ranks)]
