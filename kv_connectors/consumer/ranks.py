"""D's tensor-parallel fan-out: which producer ranks a load reads (or a heartbeat renews) on this
decode rank, asking P its TP size where the params do not state it (the transfer-id flow)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.consumer.receiver import Receiver
from kv_connectors.consumer.renewer import Renewer
from kv_connectors.consumer.tasks import FailReason, PeerKey, RecvKind, RecvTask
from kv_connectors.errors import ConfigError, KVConnectorError, TransferParamsError
from kv_connectors.layout import KVLayout, reader_count, source_ranks
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.specs import RecvSpec, StepMetadata

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)
_P_TP_TTL_S = 60.0  # how long a producer's TP size, asked once, is trusted (a restart may change it)


def rank_key(peer_key: PeerKey, p_rank: int) -> PeerKey:
    """P rank p_rank's side channel: the params name P's rank 0; rank r listens at port + r."""
    engine, host, port = peer_key
    return (engine, host, port + p_rank)


class Ranks:
    """Turns the scheduler's loads, releases and heartbeats into tasks per producer rank."""

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
        # P's TP size where the params do not state it (transfer-id flow), asked of P's rank 0 (a
        # stats request any rank answers) and kept _P_TP_TTL_S: (host, base port) -> (size, when).
        self._p_tp: dict[tuple[str, int], tuple[int, float]] = {}
        self._probes: dict[tuple[str, int], tuple[concurrent.futures.Future[wire.Body], float]] = {}  # and deadline
        self._deferred: list[tuple[str, RecvSpec]] = []  # loads waiting for their P's TP size

    def busy(self) -> bool:
        return bool(self._deferred or self._probes)

    def awaiting(self) -> bool:
        """A producer's TP size is being asked (its answer wakes the engine)."""
        return bool(self._probes)

    def take(self, meta: StepMetadata) -> None:
        """The step's heartbeats, loads and releases, and the loads the scheduler failed."""
        for rid, (peer, key, p_tp) in meta.renew_start.items():
            try:
                subs = self._sources(rid, p_tp or self._known_tp(peer))
            except KVConnectorError:
                continue  # a TP combination that cannot be served: its load fails when scheduled
            self._renewing[rid] = [sub for sub, _ in subs]
            for sub, (p_rank, _) in subs:
                self._renewer.start(sub, rank_key(peer, p_rank), key)
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
        task = RecvTask(rid, RecvSpec(("", "", 0), "", (), ()), self._clock())
        task.fail(reason, message)
        self._receiver.add(task)

    def _known_tp(self, peer_key: PeerKey) -> int | None:
        known = self._p_tp.get(peer_key[1:])
        return known[0] if known is not None and self._clock() - known[1] < _P_TP_TTL_S else None

    def _ask_tp(self, peer_key: PeerKey) -> None:
        where = peer_key[1:]
        if where not in self._probes:
            timeout = self._cfg.handshake_timeout_s
            self._probes[where] = (self._client.submit(*where, wire.StatsRequest(), "", timeout), self._clock() + timeout)

    def resolve(self) -> None:
        """Loads waiting for their P's TP size: planned once P's rank 0 said it, failed if it did not."""
        if not self.busy():
            return
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
                    peer=rank_key(spec.peer_key, p_rank),
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
        ranks = source_ranks(self._heads, p_tp, self._tp_size, self._rank)
        return [(rid if i == 0 else f"{rid}|p{p}", (p, p_tp)) for i, p in enumerate(ranks)]

    def _check_heterogeneous(self, p_tp: int | None) -> None:
        """Another TP size than P's: each D rank loads the heads of each P rank holding some of its
        own (reads them, or each such P rank writes them), where the layouts tell heads apart."""
        where = f"prefill tensor_parallel_size {p_tp}, decode {self._tp_size}"
        if self._layout.cells is None:
            raise TransferParamsError(f"{where}: this instance's KV layout does not tell heads apart (only the same TP size)")
        try:
            reader_count(self._heads, p_tp or self._tp_size, self._tp_size, 0)
        except ConfigError as e:
            raise TransferParamsError(str(e)) from e
