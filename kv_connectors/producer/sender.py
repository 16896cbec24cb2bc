"""P side of a transfer: writes into D's blocks when D asks (push), settled before D is told.

A push request names the blocks by key: P's request id (the "params" flow, after P answered)
or the transfer id both requests carry (the "transfer-id" flow, P and D sent at once). In the
transfer-id flow D may ask before P has computed anything; if its request is here when P's
step computes the prompt, each layer is written as soon as it is computed (layer-wise push).

A write that fails, times out or that D aborts is not over when it is released: P tells D it
failed (and frees the blocks it reads) only once its transport says no byte of it can move.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kv_connectors import wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.errors import KVConnectorError
from kv_connectors.fence import LeaseWords
from kv_connectors.layout import KVLayout
from kv_connectors.plan import BlockTable, TransferPlan, plan_blocks, plan_cells
from kv_connectors.producer.admission import Admission, PushBook, reader
from kv_connectors.producer.consumers import Consumers
from kv_connectors.producer.leases import SendLeases, other_prompt
from kv_connectors.transports.base import Transport, XferState

logger = logging.getLogger(__name__)

# P's push deadline ends this much (at most a tenth of the timeout) before D's could.
_DEADLINE_MARGIN_S = 1.0
_OTHER_PROMPT = "the decode request's prompt is not the prefill's (one id used for two prompts?)"
_ABORTED = "the consumer aborted the push request"

# How long a cancelled transfer id is remembered, for a D push request that arrives late.
_CANCEL_TTL_S = 600.0


@dataclasses.dataclass
class _Write:
    """One push: D's request, then the posted write(s) from P's blocks into D's."""

    request: wire.PushRequest
    deadline: float
    handles: list[Any] = dataclasses.field(default_factory=list)
    runs: int = 0
    # Layer-wise only: P's blocks of the request, D's layout, regions not written yet.
    src_blocks: tuple[int, ...] = ()
    dst: KVLayout | None = None
    regions_left: set[int] = dataclasses.field(default_factory=set)
    layers_in_forward: int = 0  # layers written from save_kv_layer, during the forward pass
    error: str = ""  # failed (or not every region written): it ends once every handle settled
    stopping: str = ""  # timed out or aborted by D: its handles are aborted; a write that lands whole still counts
    consumer: KVLayout | None = None  # D's layout when it asked: the process whose blocks these are
    aborted: set[int] = dataclasses.field(default_factory=set)  # id() of handles told to abort
    # Layer-wise: regions whose KV the device has not finished writing yet, with the signal that says so.
    pending: list[tuple[tuple[int, ...], Ready]] = dataclasses.field(default_factory=list)


# (the lease key D names the blocks by, the consumer rank's agent, its request there): two D
# requests for one lease (a router's duplicate) are two writes, each answered.
WriteKey = tuple[str, str, str]
# The device has run the kernels queued before the signal was made (a CUDA event's query(), from the
# adapter): on a GPU a layer's KV is in the cache only once its kernels ran, not when its hook returned.
Ready = Callable[[], bool]


def _tail(own: tuple[int, ...], n: int) -> tuple[int, ...]:
    """P's blocks paired with D's n blocks: the last n (D's own prefix-cache hits are not sent)."""
    return own[len(own) - n :]


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
        self._transport = transport
        self._layout = layout
        self._hash = compat.hash()
        self._layer_regions = {name: tuple(ids) for name, ids in (layer_regions or {}).items()}
        self.leases = SendLeases(words=words, epoch=epoch, writing=self._writes_from)
        self.book = PushBook()
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
        # Push requests by (lease key, consumer agent): the D ranks reading one lease each ask.
        self._waiting: dict[WriteKey, _Write] = {}  # whose lease is not known yet
        self._writing: dict[WriteKey, _Write] = {}
        self._layerwise: dict[WriteKey, _Write] = {}  # writes following this step's forward pass
        self._cancelled: dict[str, tuple[str, float]] = {}  # key -> (reason, when)
        self.pushes = 0
        self.push_failures = 0
        self.layerwise_pushes = 0

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
            self.leases.add(spec.key, rid, spec.block_ids, now, self._cfg.lease_s, spec.prompt_digest)
            if spec.cancelled:
                self.cancel(spec.key, f"prefill request {rid} was aborted")

    def _writes_from(self, key: str) -> bool:
        """A write from the blocks held under key is in flight (or follows this step's forward pass)."""
        return any(wk[0] == key for wk in self._writing) or any(wk[0] == key for wk in self._layerwise)

    def cancel(self, key: str, reason: str) -> None:
        """P's request ended without KV for D: fail D's push now (after writes in flight settle)."""
        now = self._clock()
        waiting = [wk for wk in self._waiting if wk[0] == key]
        for wk in waiting:
            self._finish(self._waiting.pop(wk), reason)
        layered = [wk for wk in self._layerwise if wk[0] == key]
        for wk in layered:
            write = self._writing[wk] = self._layerwise.pop(wk)
            write.error = reason  # its handles settle in _poll, which then tells D
            write.regions_left.clear()
        self._cancelled[key] = (reason, now)  # for every push request still to come (each D rank's)
        self.leases.notice(key, now)  # the lease, if any, ends once writes from its blocks settle

    def busy(self) -> bool:
        """Anything to advance: leases, push requests queued or waiting, writes."""
        return self.leases.active or bool(self._waiting or self._writing or self._layerwise) or not self._inbox.empty()

    def polling(self) -> bool:
        """A write is in flight or follows this step's forward pass (its completion is polled)."""
        return bool(self._writing or self._layerwise)

    def writes_layers(self) -> bool:
        """A layer-wise write follows this step's forward pass."""
        return bool(self._layerwise)

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
                logger.exception("push of %s: unexpected error", wk[0])
                self._waiting.pop(wk, None)
                self._finish(write, f"internal error: {type(e).__name__}: {e}")
        for wk in list(self._writing):
            self._poll(wk, self._writing[wk], now)
        for key in [k for k, (_r, t) in self._cancelled.items() if now - t > _CANCEL_TTL_S]:
            del self._cancelled[key]
        if self.consumers.retiring:
            self.consumers.retire({wk[1] for wk in (*self._waiting, *self._writing, *self._layerwise)})

    def _advance_waiting(self, wk: WriteKey, write: _Write, now: float) -> None:
        key = wk[0]
        if self.book.aborted(write.request):  # D gave up on it before it could be written
            del self._waiting[wk]
            self.push_failures += 1
        elif now > write.deadline:  # first: D gives these blocks up about now, a write could land after
            del self._waiting[wk]
            known = self.leases.block_ids(key) is not None
            late = "was not ready within the push's deadline" if known else "is unknown here or its blocks were already freed"
            self._finish(write, f"prefill request {key} {late}")
        elif self.leases.block_ids(key) is not None:
            del self._waiting[wk]
            self._post(wk, write)
        elif (why := self.leases.gone(key)) is not None:
            del self._waiting[wk]  # its lease already ended: fail D now, not at its deadline
            self._finish(write, f"prefill request {key}'s blocks were already freed ({why})")

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
                logger.warning("release of %s by %s ignored: %s", key, req.consumer_engine_id, _OTHER_PROMPT)
        elif self.book.aborted(req):
            self.push_failures += 1
            logger.info("push of %s to %s dropped: %s", key, req.consumer_engine_id, _ABORTED)
        elif key in self._cancelled:
            self._finish(_Write(req, now), self._cancelled[key][0])
        else:
            wk = (key, req.consumer_agent, req.consumer_request_id)
            if (dup := self._waiting.pop(wk, None)) is not None:
                self._finish(dup, "the consumer asked again for the same request")
            consumer = self.consumers.layout(req.consumer_agent)
            self._waiting[wk] = _Write(req, self._deadline(req, received_at), consumer=consumer)

    def _check(self, write: _Write, own: tuple[int, ...]) -> KVLayout | str:
        """D's layout for this push, or why it cannot be written."""
        req = write.request
        dst = self.consumers.layout(req.consumer_agent)
        if dst is None:
            return f"consumer {req.consumer_agent} did not hand-shake for push"
        if write.consumer is None or dst is not write.consumer:
            # Its blocks belong to another process now (or to none we know of when it asked).
            return f"consumer {req.consumer_agent} hand-shook again since it asked: its blocks may belong to another process"
        if dst.block_size == self._layout.block_size and len(req.block_ids) > len(own):
            return f"asked for {len(req.block_ids)} blocks, request {req.producer_request_id} holds {len(own)}"
        return dst

    def _plan(
        self, own: tuple[int, ...], dst: KVLayout, req: wire.PushRequest, regions: Sequence[int] | None = None
    ) -> TransferPlan:
        """P's blocks into D's (these regions only, if given): paired from the tail where both
        sides' blocks hold as many tokens (head slices planned where the TP sizes differ), else the
        tokens D asked for, mapped through both block tables."""
        src, to = (self._layout, dst) if regions is None else (self._layout.select(regions), dst.select(regions))
        if dst.block_size == self._layout.block_size or not req.num_tokens:
            return plan_blocks(src, _tail(own, len(req.block_ids)), to, req.block_ids)
        mine, theirs = BlockTable(own), BlockTable(req.block_ids, req.consumer_first_token)
        return plan_cells(src, mine, to, theirs, req.first_token, req.num_tokens)

    def _reader_done(self, key: str, engine: str, rank: int, now: float) -> None:
        """A consumer rank is done with the lease under key (read it, was written, or failed; engine ""
        when unknown): the lease ends once every rank of that consumer reading from us is."""
        if not engine:
            self.leases.notice(key, now)
            return
        self.leases.notice(key, now, reader(engine, rank), engine, self.consumers.readers_of(engine))

    def _post(self, wk: WriteKey, write: _Write) -> None:
        key, req = wk[0], write.request
        own = self.leases.block_ids(key)
        assert own is not None
        if (why := _other_prompt(req, self.leases.prompt_digest(key))) is not None:
            self._finish(write, why)  # the lease stays: a consumer asking with the prefill's prompt is served
            return
        dst = self._check(write, own)
        try:
            if isinstance(dst, str):
                raise KVConnectorError(dst)
            plan = self._plan(own, dst, req)
            write.runs = plan.num_runs
            notif = self._done(req, runs=plan.num_runs)
            if not self.book.start(req):  # D aborted it meanwhile (side-channel thread): never written
                return
            try:
                write.handles.append(self._transport.post_write(req.consumer_agent, plan, notif))
            except BaseException:
                self.book.end(req)  # nothing was posted
                raise
        except Exception as e:  # KVConnectorError, or a peer's layout/ids the planner cannot use
            self._finish(write, f"write failed: {e}")
            self._reader_done(key, req.consumer_engine_id, req.consumer_rank, self._clock())
            return
        self._writing[wk] = write  # its blocks are held until it settles (SendLeases: writing)

    # layer-wise push (transfer-id flow) -----------------------------------------------------------
    def begin_layerwise(self, reqs: Mapping[str, Any]) -> None:
        """Before the forward pass: prefills this step completes whose D already asked for them."""
        if not reqs:
            return
        now = self._clock()
        self._drain_inbox(now)
        for spec in reqs.values():
            if not self._layer_regions:
                break
            for wk in [wk for wk in self._waiting if wk[0] == spec.key]:  # D not here yet: pushed whole later
                write = self._waiting[wk]
                dst = self._check(write, spec.block_ids)
                if isinstance(dst, str) or _other_prompt(write.request, spec.prompt_digest) is not None or now > write.deadline:
                    continue  # the whole-request path reports it
                if not self.book.start(write.request):  # aborted by D: dropped at the next progress
                    continue
                del self._waiting[wk]
                write.src_blocks, write.dst = spec.block_ids, dst
                write.regions_left = set(range(len(self._layout.regions)))
                self._layerwise[wk] = write

    def on_layer_saved(self, layer_name: str, ready: Ready | None = None) -> None:
        """A layer's attention op returned: write its regions of every layer-wise push once its KV is
        in the cache (ready: the device ran the kernels that fill it; None: it is, as on a CPU)."""
        if not self._layerwise:
            return
        regions = self._layer_regions.get(layer_name, ())
        for write in self._layerwise.values():
            write.layers_in_forward += 1
            self._write_regions(write, regions, ready)

    def end_layerwise(self, ready: Ready | None = None) -> None:
        """After the forward pass: write what no layer hook covered (once the pass's kernels ran:
        ready); then wait for completion."""
        for wk in list(self._layerwise):
            write = self._layerwise.pop(wk)
            self._write_regions(write, tuple(write.regions_left), ready)
            self._writing[wk] = write

    def _write_regions(self, write: _Write, regions: Sequence[int], ready: Ready | None) -> None:
        """Post these regions now if their KV is in the cache, else once it is (_poll)."""
        todo = tuple(sorted(r for r in regions if r in write.regions_left))
        if not todo or write.error:
            return
        write.regions_left.difference_update(todo)
        if ready is None or ready():
            self._post_regions(write, todo)
        else:
            write.pending.append((todo, ready))

    def _post_pending(self, write: _Write) -> None:
        """Post the pending regions whose KV the device has written (in order: a later signal is
        never ready before an earlier one); none once the write failed or stops."""
        if write.error or write.stopping:
            if write.pending:
                write.error = write.error or write.stopping  # regions left unwritten: it fails
                write.pending.clear()
            return
        while write.pending and write.pending[0][1]():
            regions, _ready = write.pending.pop(0)
            self._post_regions(write, regions)

    def _post_regions(self, write: _Write, todo: Sequence[int]) -> None:
        """Post a write of these regions; a failure marks the write, which end_layerwise hands to _poll."""
        if write.error:
            return
        if self.book.aborted(write.request):  # D gave up: no more of it is written
            write.error = _ABORTED
            write.regions_left.clear()
            return
        req = write.request
        assert write.dst is not None
        try:
            plan = self._plan(write.src_blocks, write.dst, req, todo)
            write.runs += plan.num_runs
            write.handles.append(self._transport.post_write(req.consumer_agent, plan, b""))
        except Exception as e:  # KVConnectorError, or a peer's layout/ids the planner cannot use
            write.error = f"layer-wise write failed: {e}"
            write.regions_left.clear()

    def _poll(self, wk: WriteKey, write: _Write, now: float) -> None:
        """A write ends once every handle completed, or, after a failure, a timeout or D's abort,
        once every handle settled (no byte of it can land any more): only then is D told and are
        the blocks it reads freed."""
        if not write.stopping and self.book.aborted(write.request):
            write.stopping = _ABORTED
        if not write.stopping and now > write.deadline:
            write.stopping = f"write timed out after {self._cfg.transfer_timeout_s:g} s"
        self._post_pending(write)
        for handle in list(write.handles):
            try:
                state: XferState | None = self._transport.poll(handle)
            except KVConnectorError as e:
                write.error = write.error or f"write failed: {e}"
                state = None
            if state is XferState.DONE:
                self._transport.release(handle)
                write.handles.remove(handle)
                continue
            if write.error or write.stopping:
                if id(handle) not in write.aborted:
                    write.aborted.add(id(handle))
                    self._transport.abort(handle)
                if self._transport.settled(handle):  # ended without completing (or so its engine says)
                    write.error = write.error or write.stopping
                    self._transport.release(handle)
                    write.handles.remove(handle)
        if write.handles or write.pending:
            return  # in flight, settling, or waiting for the device
        del self._writing[wk]
        req = write.request
        self.book.end(req)
        self._reader_done(wk[0], req.consumer_engine_id, req.consumer_rank, now)  # written or failed: free either way
        if write.error:
            self._finish(write, write.error)
            return
        self.pushes += 1
        if write.dst is not None:  # layer-wise: the notification follows the last write
            self.layerwise_pushes += int(write.layers_in_forward > 0)
            self._notify(write.request, self._done(write.request, runs=write.runs))

    def _done(self, req: wire.PushRequest, error: str = "", runs: int = 0) -> bytes:
        return wire.encode(
            wire.TransferDone(req.consumer_request_id, self._cfg.engine_id, error, runs, attempt=req.attempt), self._hash
        )

    def _finish(self, write: _Write, error: str) -> None:
        """Tell D its push failed: nothing of it is in flight, and it is never written from now on
        (a copy of the request arriving later is refused). Best effort: D's abort covers a lost message."""
        self.push_failures += 1
        req = write.request
        self.book.close(req)
        if error == _ABORTED:
            logger.info("push of %s to %s ended: %s", req.producer_request_id, req.consumer_engine_id, error)
        else:
            logger.error("push of %s to %s failed: %s", req.producer_request_id, req.consumer_engine_id, error)
        self._notify(req, self._done(req, error))

    def _notify(self, req: wire.PushRequest, msg: bytes) -> None:
        try:
            self._transport.send_notif(req.consumer_agent, msg)
        except KVConnectorError as e:
            logger.debug("could not tell %s: %s", req.consumer_engine_id, e)

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
        for write in [*self._writing.values(), *self._layerwise.values()]:
            for handle in write.handles:
                self._transport.release(handle)
        self._writing.clear()
        self._layerwise.clear()


def _other_prompt(req: wire.PushRequest, digest: str) -> str | None:
    """Why a push request is not for this prefill's KV (D's prompt is another), or None: the same
    prompt, or a side that stated no digest. Under a transfer id a router reused for two prompts,
    writing would have D answer its prompt from another prompt's KV."""
    if not other_prompt(req.prompt_digest, digest):
        return None
    return f"decode request {req.consumer_request_id} under {req.producer_request_id!r}: {_OTHER_PROMPT}; not written"
