"""D side: heartbeats that keep P's leases alive while D's requests wait, in D's queue and after.

The scheduler side names the requests queued longer than `lease_renew_after_s` (and those that
left the queue); the receiver names the loads still waiting that long after they arrived (a
handshake, a connect, a push, a read: LoadHeartbeats). The worker renews their leases, batched per
producer, at a third of the producer's lease (learnt from its answer). A D that stops renewing
loses the KV at lease expiry, and its read is then refused by the fence.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Mapping

from kv_connectors import sidechannel, wire
from kv_connectors.consumer.tasks import RecvKind, RecvPhase, RecvTask, TaskKey
from kv_connectors.specs import ProducerAddress

logger = logging.getLogger(__name__)

_FIRST_INTERVAL_S = 0.5  # until a producer told us its lease
# A load in these phases still needs P's blocks.
_WAITING = frozenset({RecvPhase.HANDSHAKE, RecvPhase.PUSH_REQUESTED, RecvPhase.AWAITING_WRITE, RecvPhase.READING})


@dataclasses.dataclass
class _Producer:
    keys: dict[str, str] = dataclasses.field(default_factory=dict)  # D's request id -> P's key
    interval_s: float = _FIRST_INTERVAL_S
    next_at: float = 0.0
    future: concurrent.futures.Future[wire.Body] | None = None


class Renewer:
    """Engine thread only; the requests themselves run on the side-channel client's threads."""

    def __init__(
        self,
        engine_id: str,
        compat_hash: str,
        client: sidechannel.Client,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._engine_id = engine_id
        self._hash = compat_hash
        self._client = client
        self._timeout_s = timeout_s
        self._clock = clock
        self._producers: dict[ProducerAddress, _Producer] = {}
        self._where: dict[str, ProducerAddress] = {}  # D's request id -> its producer
        self.renewals = 0  # keys renewed (P confirmed a live lease)

    def start(self, rid: str, peer: ProducerAddress, key: str) -> None:
        producer = self._producers.setdefault(peer, _Producer())
        producer.keys[rid] = key
        self._where[rid] = peer

    def stop(self, rid: str) -> None:
        peer = self._where.pop(rid, None)
        if peer is None:
            return
        producer = self._producers[peer]
        producer.keys.pop(rid, None)
        if not producer.keys and producer.future is None:
            del self._producers[peer]

    def busy(self) -> bool:
        """Heartbeats to send or answers to settle."""
        return bool(self._producers)

    def progress(self) -> None:
        now = self._clock()
        for peer, producer in list(self._producers.items()):
            if producer.future is not None:
                if not producer.future.done():
                    continue
                self._settle(peer, producer)
            if not producer.keys:
                del self._producers[peer]
                continue
            if now >= producer.next_at:
                _engine, host, port = peer
                body = wire.RenewRequest(self._engine_id, sorted(set(producer.keys.values())))
                producer.future = self._client.submit(host, port, body, self._hash, self._timeout_s)
                producer.next_at = now + producer.interval_s

    def _settle(self, peer: ProducerAddress, producer: _Producer) -> None:
        future, producer.future = producer.future, None
        assert future is not None
        try:
            reply = future.result()
            if not isinstance(reply, wire.RenewReply):
                raise TypeError(f"unexpected answer {type(reply).__name__}")
        except Exception as e:  # best effort: the lease (and the fence) decide what happens
            logger.warning("could not renew leases at %s:%d: %s", peer[1], peer[2], e)
            return
        self.renewals += sum(reply.known)
        if reply.lease_s > 0:
            producer.interval_s = max(0.05, reply.lease_s / 3)


class LoadHeartbeats:
    """Heartbeats from the moment D has a load, not only while it is queued: a load still waiting
    (handshake, connect, push, read) `renew_after_s` after it arrived renews P's lease until it ends,
    so that a slow handshake or connect does not outlive the lease and cost the request its KV. A
    load done sooner costs P no message. Engine thread only."""

    def __init__(self, renewer: Renewer, renew_after_s: float) -> None:
        self._renewer = renewer
        self._after_s = renew_after_s
        self._renewing: set[TaskKey] = set()

    def keep(self, tasks: Mapping[TaskKey, RecvTask], now: float) -> None:
        for key in [k for k in self._renewing if (t := tasks.get(k)) is None or t.phase not in _WAITING]:
            self._renewing.discard(key)
            self._renewer.stop(_renewal_id(key))
        for task in tasks.values():
            if (
                task.kind is RecvKind.LOAD
                and task.phase in _WAITING
                and task.key not in self._renewing
                and now - task.created >= self._after_s
            ):
                self._renewing.add(task.key)
                self._renewer.start(_renewal_id(task.key), task.peer_key, task.remote_request_id)


def _renewal_id(key: TaskKey) -> str:
    """A load's id in the renewer (apart from the scheduler's queued requests, named by request id)."""
    return f"{key[1]}@load"
