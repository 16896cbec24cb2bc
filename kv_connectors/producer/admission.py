"""P's side-channel answers (on the side-channel thread): handshakes, claims, renewals, push requests
and their aborts. Nothing here touches the transport: what needs the engine thread is queued."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence

import msgspec

from kv_connectors import tp, wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import KVConnectorError, TransferParamsError
from kv_connectors.groups import MAX_GROUPS
from kv_connectors.layout import KVLayout
from kv_connectors.producer.leases import SendLeases
from kv_connectors.wire import ClaimResult

logger = logging.getLogger(__name__)

_MAX_CLAIM_ITEMS = 65536  # requests in one claim (D batches those ready in one step)
_TOMBSTONES = 100_000  # aborted push attempts remembered (oldest forgotten first)

Attempt = tuple[str, str, str]  # (consumer agent, its request id, the attempt D named)


def attempt_of(request: wire.PushRequest) -> Attempt:
    return (request.consumer_agent, request.consumer_request_id, request.attempt)


def reader(engine_id: str, rank: int) -> str:
    """A consumer rank, as claims and notices name it."""
    return f"{engine_id}#{rank}"


class PushBook:
    """Which push attempts have a write in flight (or about to be posted), and which D aborted.

    Shared by the side-channel thread (an abort, a new push request) and the engine thread (a write
    starts or settles), under one lock: an abort answered "settled" means no write of it is in
    flight, and none can start afterwards (start() refuses an aborted attempt)."""

    def __init__(self, cap: int = _TOMBSTONES) -> None:
        self._lock = threading.Lock()
        self._in_flight: set[Attempt] = set()
        self._aborted: collections.OrderedDict[Attempt, None] = collections.OrderedDict()
        self._cap = cap

    def start(self, request: wire.PushRequest) -> bool:
        """A write for this request is about to be posted: False if D aborted it (then it must not be)."""
        a = attempt_of(request)
        with self._lock:
            if a in self._aborted:
                return False
            self._in_flight.add(a)
            return True

    def end(self, request: wire.PushRequest) -> None:
        """No write of this request is in flight any more (completed, or settled after a failure)."""
        with self._lock:
            self._in_flight.discard(attempt_of(request))

    def close(self, request: wire.PushRequest) -> None:
        """This request will not be written (P failed it): a copy arriving later is refused too."""
        with self._lock:
            self._tombstone(attempt_of(request))

    def aborted(self, request: wire.PushRequest) -> bool:
        with self._lock:
            return attempt_of(request) in self._aborted

    def abort(self, a: Attempt) -> bool:
        """D gives up on an attempt: tombstoned; True if no write of it is in flight (settled)."""
        with self._lock:
            self._tombstone(a)
            return a not in self._in_flight

    def _tombstone(self, a: Attempt) -> None:
        self._aborted[a] = None
        self._aborted.move_to_end(a)
        while len(self._aborted) > self._cap:
            self._aborted.popitem(last=False)

    @property
    def writing(self) -> int:
        with self._lock:
            return len(self._in_flight)


class Admission:
    """Answers D's side-channel requests for this producer rank (the side-channel thread)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        leases: SendLeases,
        book: PushBook,
        layout: KVLayout,
        compat: wire.CompatInfo,
        identity: wire.HandshakeReply,
        clock: Callable[[], float],
        queue_push: Callable[[wire.PushRequest, float], None],
        queue_handshake: Callable[[wire.HandshakeRequest], None],
    ) -> None:
        """identity: what a handshake is answered (this rank's agent, metadata, layout, epoch, words)."""
        self._cfg = cfg
        self._leases = leases
        self._book = book
        self._layout = layout
        self._compat = compat
        self._hash = compat.hash()
        self._identity = identity
        self.epoch = identity.epoch
        self._clock = clock
        self._queue_push = queue_push
        self._queue_handshake = queue_handshake

    def handle(self, body: wire.Body) -> wire.Body:
        """One request from a D (every kind but stats, which the worker answers)."""
        if isinstance(body, wire.PushRequest):
            return self.on_push(body)
        if isinstance(body, wire.AbortPush):
            return self.on_abort(body)
        if isinstance(body, wire.ClaimRequest):
            return self.on_claim(body)
        if isinstance(body, wire.RenewRequest):
            return self.on_renew(body)
        if isinstance(body, wire.HandshakeRequest):
            return self.on_handshake(body)
        return wire.ErrorReply(wire.ErrorCode.BAD_REQUEST, f"unexpected {type(body).__name__}")

    def on_handshake(self, body: wire.HandshakeRequest) -> wire.Body:
        """A D rank hand-shakes: refused if it cannot read this rank's heads or its model differs;
        else answered, and queued for the engine thread (which connects it, for push)."""
        me = self._identity
        tell_heads = self._layout.cells is not None and body.layout is not None and body.layout.cells is not None
        why = tp.handshake_refusal(self._compat.num_kv_heads, me.rank, me.tp_size, body.rank, body.tp_size, tell_heads)
        if why:
            logger.error("refused peer %s: %s", body.engine_id, why)
            return wire.ErrorReply(wire.ErrorCode.INCOMPATIBLE, why)
        if body.compat.hash() != self._hash:
            diff = self._compat.diff(body.compat, mine="server", theirs="client")
            logger.error("refused incompatible peer %s: %s", body.engine_id, diff)
            return wire.ErrorReply(wire.ErrorCode.INCOMPATIBLE, diff)
        logger.info("handshake from engine %s rank %d", body.engine_id, body.rank)
        if body.agent_name and body.layout is not None:
            self._queue_handshake(body)
        return msgspec.structs.replace(me, epoch=self.epoch)

    def on_push(self, request: wire.PushRequest) -> wire.PushAck:
        """Queue a push request for the engine thread; the answer names this process (a D whose
        handshake was with an earlier one hand-shakes again: this one cannot reach it)."""
        if len(request.block_ids) > self._layout.num_blocks:  # no request of ours holds that many
            too_many = f"{len(request.block_ids)} blocks asked; this instance has {self._layout.num_blocks}"
            return wire.PushAck(False, too_many, self.epoch)
        if len(request.group_sizes) > MAX_GROUPS:
            return wire.PushAck(False, f"{len(request.group_sizes)} KV cache groups named; at most {MAX_GROUPS}", self.epoch)
        if request.attempt and self._book.aborted(request):
            return wire.PushAck(False, "the consumer aborted this push request", self.epoch)
        key = request.producer_request_id
        if request.block_ids and (why := self._leases.gone(key)) is not None:
            # Refused here, not on the engine thread: a P with nothing else to do does not step
            # (vLLM's engine waits for a request), and D would wait out its deadline.
            return wire.PushAck(False, f"prefill request {key}'s blocks were already freed ({why})", self.epoch)
        self._queue_push(request, self._clock())
        return wire.PushAck(True, epoch=self.epoch)

    def on_abort(self, request: wire.AbortPush) -> wire.PushSettled:
        """D gives up on a push: never start a write for it; settled once none is in flight."""
        settled = self._book.abort((request.consumer_agent, request.consumer_request_id, request.attempt))
        return wire.PushSettled(settled, self.epoch)

    def on_claim(self, request: wire.ClaimRequest) -> wire.ClaimReply:
        """The fence: hold each live lease a consumer is reading for it; refuse those that already
        ended (their blocks may hold other prompts' KV by now)."""
        now = self._clock()
        hold_s = self._cfg.transfer_timeout_s
        if len(request.items) > _MAX_CLAIM_ITEMS or any(len(i.block_ids) > self._layout.num_blocks for i in request.items):
            raise TransferParamsError(
                f"claim of {len(request.items)} requests is larger than any this "
                f"instance ({self._layout.num_blocks} blocks) can hold"
            )
        if request.epoch and request.epoch != self.epoch:  # D hand-shook with an earlier process here
            why = "the producer restarted since the handshake"
            n = len(request.items)
            return wire.ClaimReply([ClaimResult.GONE.value] * n, [why] * n, hold_s, self.epoch)
        claims = [
            self._leases.claim(
                item.key, reader(request.consumer_engine_id, request.consumer_rank), tuple(item.block_ids), now, hold_s
            )
            for item in request.items
        ]
        return wire.ClaimReply([c.result.value for c in claims], [c.reason for c in claims], hold_s, self.epoch)

    def on_renew(self, request: wire.RenewRequest) -> wire.RenewReply:
        """Heartbeat: D's requests still queued; extend their leases."""
        now = self._clock()
        known = [self._leases.renew(key, now, self._cfg.lease_s) for key in request.keys]
        return wire.RenewReply(known, self._cfg.lease_s)


class Desk:
    """What this rank's side channel answers (the server thread): stats (any rank, P or D: the worker's
    last snapshot), every other request P's Admission's once registered (NOT_READY until then). A
    request the engine acts on (anything but stats) ends its idle wait (wake)."""

    def __init__(self, stats: wire.StatsReply, wake: Callable[[], None]) -> None:
        self.stats = stats
        self.ranks: tuple[str, ...] = ()  # every rank's side-channel address (set_ranks)
        self.admission: Admission | None = None  # set once every part exists: until then, not ready
        self._wake = wake

    def set_ranks(self, addresses: Sequence[str], address: str) -> None:
        """Every rank's side-channel address, by rank; address: this rank's. Rank 0 names the others
        to a peer that asks (config.PortLayout)."""
        rank, tp_size = self.stats.rank, self.stats.tp_size
        if len(addresses) != tp_size or addresses[rank] != address:
            raise KVConnectorError(f"rank {rank} of {tp_size} was given side channels {list(addresses)}")
        self.ranks = tuple(addresses)
        self.stats = msgspec.structs.replace(self.stats, ranks=self.ranks)

    def answer(self, body: wire.Body) -> wire.Body:
        if isinstance(body, wire.StatsRequest):
            return self.stats
        admission = self.admission
        reply = (
            admission.handle(body)
            if admission is not None
            else wire.ErrorReply(wire.ErrorCode.NOT_READY, "KV cache not registered yet")
        )
        self._wake()
        return reply
