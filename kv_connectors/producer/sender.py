"""P side of a transfer: its leases, the push requests D sends (queued, then waiting for their
lease), and the writes they become (kv_connectors.producer.writes).

A push request names the blocks by key: P's request id (the "params" flow, after P answered)
or the transfer id both requests carry (the "transfer-id" flow, P and D sent at once). In the
transfer-id flow D may ask before P has computed anything; if its request is here when P's
step computes the prompt, each layer is written as soon as it is computed (layer-wise push).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kv_connectors import wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.fence import LeaseWords
from kv_connectors.layout import KVLayout
from kv_connectors.producer.admission import Admission, PushBook, reader
from kv_connectors.producer.consumers import Consumers
from kv_connectors.producer.leases import SendLeases
from kv_connectors.producer.writes import ABORTED, OTHER_PROMPT, Ready, Unwritable, Write, WriteKey, Writes, other_prompt_reason
from kv_connectors.transports.base import Transport

logger = logging.getLogger(__name__)

# P's push deadline ends this much (at most a tenth of the timeout) before D's could.
_DEADLINE_MARGIN_S = 1.0
# How long a cancelled transfer id is remembered, for a D push request that arrives late.
_CANCEL_TTL_S = 600.0

__all__ = ["Ready", "Sender"]


class Sender:
    """Owns P's leases and push writes. Side-channel answers (Admission, other thread) only enqueue;
    every transport call happens on the engine's thread (progress, layer hooks, take_finished)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        transport: Transport,
        layout: KVLayout,
        compat: wire.CompatInfo,
        layer_regions: Mapping[str, Sequence[int]] | None = None,
        *,
        identity: wire.HandshakeReply,
        clock: Callable[[], float] = time.monotonic,
        words: LeaseWords | None = None,
    ) -> None:
        """identity: what this rank answers a handshake (its agent, epoch, rank and TP size...);
        words: this rank's lease words (kv_connectors.fence), registered with the transport."""
        epoch, rank, tp_size = identity.epoch, identity.rank, identity.tp_size
        self._cfg = cfg
        self._clock = clock
        self._block_size = layout.block_size
        self.book = PushBook()
        self.writes = Writes(
            cfg, transport, layout, compat.hash(), layer_regions or {}, book=self.book, clock=clock, reader_done=self._reader_done
        )
        self.leases = SendLeases(words=words, epoch=epoch, writing=self.writes.from_key)
        # Handshakes, and push requests with the time they arrived (D's deadline runs from about then).
        self._inbox: queue.SimpleQueue[wire.HandshakeRequest | tuple[wire.PushRequest, float]] = queue.SimpleQueue()
        self.admission = Admission(
            cfg,
            leases=self.leases,
            book=self.book,
            layout=layout,
            compat=compat,
            identity=identity,
            clock=clock,
            queue_push=self._queue_push,
            queue_handshake=self._inbox.put,
        )
        self.consumers = Consumers(transport, rank, tp_size, compat.num_kv_heads)
        # Push requests whose lease is not known yet, by (lease key, consumer agent, its request).
        self._waiting: dict[WriteKey, Write] = {}
        self._cancelled: dict[str, tuple[str, float]] = {}  # key -> (reason, when)

    @property
    def pushes(self) -> int:
        return self.writes.pushes

    @property
    def push_failures(self) -> int:
        return self.writes.failures

    @property
    def layerwise_pushes(self) -> int:
        return self.writes.layerwise_pushes

    @property
    def epoch(self) -> str:
        """This process's start (what the side channel answers: a restarted P is a new peer)."""
        return self.admission.epoch

    @epoch.setter
    def epoch(self, value: str) -> None:
        self.admission.epoch = value

    # side-channel thread ------------------------------------------------------------------------
    def _queue_push(self, request: wire.PushRequest, received_at: float) -> None:
        self._inbox.put((request, received_at))

    # engine thread ----------------------------------------------------------------------------
    def add_leases(self, reqs: Mapping[str, Any]) -> None:
        """reqs: request id -> SendSpec (block_ids, key, cancelled)."""
        now = self._clock()
        for rid, spec in reqs.items():
            self.leases.add(spec.key, rid, spec.block_ids, now, self._cfg.lease_s, spec.prompt_digest, spec.group_sizes)
            if spec.cancelled:
                self.cancel(spec.key, f"prefill request {rid} was aborted")

    def cancel(self, key: str, reason: str) -> None:
        """P's request ended without KV for D: fail D's push now (after writes in flight settle)."""
        now = self._clock()
        waiting = [wk for wk in self._waiting if wk.lease == key]
        for wk in waiting:
            self.writes.finish(self._waiting.pop(wk), reason)
        self.writes.cancel(key, reason)
        self._cancelled[key] = (reason, now)  # for every push request still to come (each D rank's)
        self.leases.notice(key, now)  # the lease, if any, ends once writes from its blocks settle

    def busy(self) -> bool:
        """Anything to advance: leases, push requests queued or waiting, writes."""
        return self.leases.active or bool(self._waiting) or self.writes.busy() or not self._inbox.empty()

    def polling(self) -> bool:
        """A write is in flight or follows this step's forward pass (its completion is polled)."""
        return self.writes.busy()

    def writes_layers(self) -> bool:
        """A layer-wise write follows this step's forward pass."""
        return self.writes.writes_layers()

    def take_requests(self) -> None:
        """Act on what the side channel queued (handshakes connect consumers, push requests wait for
        their lease). The worker calls this before reading the transport's notifications, so that a
        consumer that just hand-shook is known when its first staged message arrives."""
        self._drain_inbox(self._clock())

    def progress(self) -> None:
        now = self._clock()
        self._drain_inbox(now)
        for wk in list(self._waiting):
            write = self._waiting[wk]
            try:
                self._advance_waiting(wk, write, now)
            except Exception as e:  # boundary: a bug or a peer's bad request fails that push, never the step
                logger.exception("push of %s: unexpected error", wk.lease)
                self._waiting.pop(wk, None)
                self.writes.finish(write, f"internal error: {type(e).__name__}: {e}")
        self.writes.poll(now)
        for key in [k for k, (_r, t) in self._cancelled.items() if now - t > _CANCEL_TTL_S]:
            del self._cancelled[key]
        if self.consumers.retiring:
            self.consumers.retire({wk.agent for wk in self._waiting} | self.writes.agents())

    def _advance_waiting(self, wk: WriteKey, write: Write, now: float) -> None:
        key = wk.lease
        if self.book.aborted(write.request):  # D gave up on it before it could be written
            del self._waiting[wk]
            self.writes.dropped()
        elif now > write.deadline:  # first: D gives these blocks up about now, a write could land after
            del self._waiting[wk]
            known = self.leases.block_ids(key) is not None
            late = "was not ready within the push's deadline" if known else "is unknown here or its blocks were already freed"
            self.writes.finish(write, f"prefill request {key} {late}")
        elif self.leases.block_ids(key) is not None:
            del self._waiting[wk]
            self._post(wk, write)
        elif (why := self.leases.gone(key)) is not None:
            del self._waiting[wk]  # its lease already ended: fail D now, not at its deadline
            self.writes.finish(write, f"prefill request {key}'s blocks were already freed ({why})")

    def _deadline(self, request: wire.PushRequest, received_at: float) -> float:
        """When a push must have been written, from when its request arrived: D's own wait (its
        budget, at most our transfer timeout) began before that and ends after its acknowledgement,
        so P stops (a margin) before D gives up; D then aborts and waits for P's confirmation."""
        timeout = self._cfg.transfer_timeout_s
        if request.budget_s > 0:
            timeout = min(timeout, request.budget_s)
        return received_at + timeout - min(_DEADLINE_MARGIN_S, timeout / 10)

    def _drain_inbox(self, now: float) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, wire.HandshakeRequest):
                self.consumers.connect(msg)
            else:
                self._take_push(*msg, now)

    def _take_push(self, req: wire.PushRequest, received_at: float, now: float) -> None:
        key = req.producer_request_id
        if not req.block_ids:  # D needs nothing: free now (unless it names another prompt)
            if not self.leases.notice(key, now, prompt_digest=req.prompt_digest):
                logger.warning("release of %s by %s ignored: %s", key, req.consumer_engine_id, OTHER_PROMPT)
        elif self.book.aborted(req):
            self.writes.dropped()
            logger.info("push of %s to %s dropped: %s", key, req.consumer_engine_id, ABORTED)
        elif key in self._cancelled:
            self.writes.finish(Write(req, now), self._cancelled[key][0])
        else:
            wk = WriteKey(key, req.consumer_agent, req.consumer_request_id)
            if (dup := self._waiting.pop(wk, None)) is not None:
                self.writes.finish(dup, "the consumer asked again for the same request")
            consumer = self.consumers.layout(req.consumer_agent)
            self._waiting[wk] = Write(req, self._deadline(req, received_at), consumer=consumer, received_at=received_at)

    def _check(self, write: Write, own: tuple[int, ...]) -> KVLayout | Unwritable:
        """D's layout for this push, or why it cannot be written."""
        req = write.request
        dst = self.consumers.layout(req.consumer_agent)
        if dst is None:
            return Unwritable(f"consumer {req.consumer_agent} did not hand-shake for push")
        if write.consumer is None or dst is not write.consumer:
            # Its blocks belong to another process now (or to none we know of when it asked).
            return Unwritable(
                f"consumer {req.consumer_agent} hand-shook again since it asked: its blocks may belong to another process"
            )
        if dst.block_size == self._block_size and len(req.block_ids) > len(own):
            return Unwritable(f"asked for {len(req.block_ids)} blocks, request {req.producer_request_id} holds {len(own)}")
        return dst

    def _reader_done(self, key: str, engine: str, rank: int, now: float) -> None:
        """A consumer rank is done with the lease under key (read it, was written, or failed; engine ""
        when unknown): the lease ends once every rank of that consumer reading from us is."""
        if not engine:
            self.leases.notice(key, now)
            return
        self.leases.notice(key, now, reader(engine, rank), engine, self.consumers.readers_of(engine))

    def _post(self, wk: WriteKey, write: Write) -> None:
        key, req = wk.lease, write.request
        own = self.leases.block_ids(key)
        assert own is not None
        if (why := other_prompt_reason(req, self.leases.prompt_digest(key))) is not None:
            self.writes.finish(write, why)  # the lease stays: a consumer asking with the prefill's prompt is served
            return
        self.writes.post(wk, write, own, self._check(write, own), self.leases.group_sizes(key))

    # layer-wise push (transfer-id flow) -----------------------------------------------------------
    def begin_layerwise(self, reqs: Mapping[str, Any]) -> None:
        """Before the forward pass: prefills this step completes whose D already asked for them."""
        if not reqs or not self.writes.layerwise:
            return
        now = self._clock()
        self._drain_inbox(now)
        for spec in reqs.values():
            for wk in [wk for wk in self._waiting if wk.lease == spec.key]:  # D not here yet: pushed whole later
                write = self._waiting[wk]
                dst = self._check(write, spec.block_ids)
                if isinstance(dst, Unwritable) or other_prompt_reason(write.request, spec.prompt_digest) is not None:
                    continue  # the whole-request path reports it
                if now > write.deadline:
                    continue
                if self.writes.begin_layerwise(wk, write, spec.block_ids, dst):
                    del self._waiting[wk]  # else aborted by D: dropped at the next progress

    def on_layer_saved(self, layer_name: str, ready: Ready | None = None) -> None:
        self.writes.on_layer_saved(layer_name, ready)

    def end_layerwise(self, ready: Ready | None = None) -> None:
        self.writes.end_layerwise(ready)

    def take_finished(self, notices: list[wire.TransferDone]) -> set[str]:
        """Request ids whose blocks can be freed: read (D's notices), written, or lease expired."""
        now = self._clock()
        for notice in notices:
            self._reader_done(notice.request_id, notice.engine_id, notice.rank, now)
        done, expired = self.leases.take_finished(now)
        for rid in expired:
            logger.warning("request %s: decode side never read its KV; freed after %.0f s lease", rid, self._cfg.lease_s)
        return done | expired

    def close(self) -> None:
        self.writes.close()
