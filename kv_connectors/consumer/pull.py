"""D's fenced pull: plan a read of P's blocks, post it, and count it only once P's lease words or a
granted claim prove that every byte read was the prompt's KV (kv_connectors.fence)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kv_connectors import wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.consumer.producers import Producer, Producers
from kv_connectors.consumer.tasks import (
    ClaimBatch,
    FailReason,
    Fence,
    FenceStep,
    Read,
    ReadStep,
    RecvPhase,
    RecvTask,
)
from kv_connectors.errors import KVConnectorError, PeerProtocolError, StaleReadError, TransferTimeoutError
from kv_connectors.fence import LeaseWords, lease_word
from kv_connectors.layout import KVLayout
from kv_connectors.plan import TransferPlan, plan_blocks
from kv_connectors.specs import ProducerAddress
from kv_connectors.transports.base import Transport, XferState
from kv_connectors.wire import ClaimResult

logger = logging.getLogger(__name__)

_CLAIM_RETRY_S = 0.02  # P's worker has not added the lease yet (it does at its next step): ask again
_FENCE_MARGIN = 0.95  # of P's hold: clocks on two hosts may run at slightly different rates

Fail = Callable[[RecvTask, FailReason, Exception], None]


class Pull:
    """Reads for the receiver's tasks in READING. Claims are batched per producer and sent at the
    end of each progress call (`send_claims`); planned reads are posted after them (`post`)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        transport: Transport,
        layout: KVLayout,
        producers: Producers,
        *,
        clock: Callable[[], float],
        scratch: LeaseWords | None,
        fail: Fail,
        complete: Callable[[RecvTask], None],
        notify: Callable[[str, str], None],
    ) -> None:
        self._cfg = cfg
        self._rank = rank
        self._transport = transport
        self._layout = layout
        self._producers = producers
        self._clock = clock
        self._scratch = scratch
        self._fail = fail
        self._complete = complete
        self._notify = notify
        self._to_claim: dict[ProducerAddress, list[RecvTask]] = {}
        self._to_post: list[RecvTask] = []
        self.claims_refused = 0
        self.fenced_by_words = 0

    # starting ---------------------------------------------------------------------------------
    def start(self, task: RecvTask, peer: Producer) -> None:
        """Plan the read and queue its claim (or, with lease words, nothing: they are read once the
        data landed, and a claim is sent only if they prove nothing). The read is posted once this
        progress call's claims are on their way: engines may copy inside the post call (NIXL over
        cma), and the claim's round trip then overlaps the copy instead of following it.

        The read carries no notification: P learns that D is done only after it granted the claim
        (a notice arriving first would free the lease, and the claim would then be refused)."""
        assert peer.layout is not None
        try:
            plan = self._plan(task, peer.layout)
        except KVConnectorError as e:
            self._fail(task, FailReason.TRANSFER, e)
            return
        started = self._clock()
        task.phase = RecvPhase.READING
        task.read = Read(plan, peer.epoch)  # the producer process read from: its leases alone can prove the read
        task.num_bytes, task.num_descriptors = plan.total_bytes, plan.num_runs
        task.started = started
        task.deadline = started + self._cfg.transfer_timeout_s
        claim_deadline = started + self._cfg.handshake_timeout_s
        if peer.words is not None and plan.num_runs > 0 and task.spec.tokens.pairs_blocks(peer.layout, self._layout):
            # The words land at our blocks' slots: P's blocks must pair with ours one to one.
            task.fence = Fence(FenceStep.AWAIT_WORDS, claim_deadline)
        else:
            task.fence = Fence(FenceStep.CLAIM_DUE, claim_deadline, due_at=started)
            self.advance(task, started)  # queues the claim
        self._to_post.append(task)

    def _plan(self, task: RecvTask, remote: KVLayout) -> TransferPlan:
        """Blocks paired one to one where both sides' blocks hold as many tokens; else the task's
        tokens, mapped through both block tables."""
        spec = task.spec
        if spec.tokens.pairs_blocks(remote, self._layout):  # plan_blocks refuses lists of unequal length
            return plan_blocks(remote, spec.remote_block_ids, self._layout, spec.local_block_ids)
        return spec.tokens.plan(remote, spec.remote_block_ids, self._layout, spec.local_block_ids)

    def post(self, advance: Callable[[RecvTask], None]) -> None:
        """Post the reads planned in this progress call (their claims have left)."""
        tasks, self._to_post = self._to_post, []
        for task in tasks:
            read = task.read
            if task.phase is not RecvPhase.READING or read is None or read.step is not ReadStep.PLANNED:
                continue
            try:
                read.handle = self._transport.post_read(self._producers.get(task.peer_key).agent_name, read.plan, b"")
                read.step = ReadStep.IN_FLIGHT
            except KVConnectorError as e:
                read.step = ReadStep.LANDED  # nothing was posted: nothing can land
                self._fail(task, FailReason.TRANSFER, e)
                continue
            if task.fence is not None and task.fence.step is FenceStep.AWAIT_WORDS:
                advance(task)  # an engine that copied inside the post (NIXL over cma) is done: the words now

    # claims -----------------------------------------------------------------------------------
    def send_claims(self) -> None:
        """One ClaimRequest per producer for every read waiting to claim."""
        for key, tasks in self._to_claim.items():
            epoch = self._producers.get(key).epoch
            for t in tasks:
                if t.phase is RecvPhase.READING and t.read is not None and t.read.epoch != epoch:
                    # a new process answers there now
                    self._fail(t, FailReason.FENCE, StaleReadError("the producer restarted during the read"))
            tasks = [t for t in tasks if t.phase is RecvPhase.READING]
            if not tasks:
                continue
            request = wire.ClaimRequest(
                self._cfg.engine_id,
                [wire.ClaimItem(t.remote_request_id, list(t.remote_block_ids)) for t in tasks],
                epoch=epoch,
                consumer_rank=self._rank,
            )
            sent_at = self._clock()
            batch = ClaimBatch(self._producers.submit(key, request), sent_at, {t.key: i for i, t in enumerate(tasks)})
            for t in tasks:
                assert t.fence is not None
                t.fence.step, t.fence.batch = FenceStep.CLAIMING, batch
        self._to_claim.clear()

    # progress ---------------------------------------------------------------------------------
    def advance(self, task: RecvTask, now: float) -> None:
        """The read counts once it landed and either P's lease words, read after it, are the
        lease's, or P granted the claim before it could lapse."""
        read, fence = task.read, task.fence
        assert read is not None and fence is not None
        if read.step is ReadStep.IN_FLIGHT:
            try:
                state = self._transport.poll(read.handle)
            except KVConnectorError as e:
                self._fail(task, FailReason.TRANSFER, e)
                return
            if state is XferState.DONE:
                self._transport.release(read.handle)
                read.handle, read.step, read.landed_at = None, ReadStep.LANDED, now
        if read.step is ReadStep.LANDED and fence.step in (FenceStep.AWAIT_WORDS, FenceStep.READING_WORDS):
            self._advance_words(task, fence, now)
        if task.phase is RecvPhase.READING:
            self._advance_claim(task, fence, now)
        if task.phase is not RecvPhase.READING:
            return
        if read.step is ReadStep.LANDED and fence.step in (FenceStep.GRANTED, FenceStep.PROVED):
            if fence.step is FenceStep.GRANTED and read.landed_at > fence.hold_until:
                why = "the read completed after the producer's hold on its blocks may have ended"
                self._fail(task, FailReason.FENCE, StaleReadError(why))
                return
            self._notify(self._producers.get(task.peer_key).agent_name, task.remote_request_id)
            self._complete(task)
            return
        limit = min(task.deadline, fence.hold_until) if fence.step is FenceStep.GRANTED else task.deadline
        if now > limit:
            why = f"transfer timed out after {now - task.started:.1f} s"
            self._fail(task, FailReason.TIMEOUT, TransferTimeoutError(why))

    def _advance_words(self, task: RecvTask, fence: Fence, now: float) -> None:
        """After the data read: read P's lease words for its blocks, then compare them with the
        lease's word. Equal: the lease was live when they were read, after every byte of the data
        (kv_connectors.fence); otherwise (not added yet, ended, shared) claim the lease instead."""
        assert task.read is not None
        peer = self._producers.get(task.peer_key)
        if fence.step is FenceStep.AWAIT_WORDS:
            if peer.words is None or self._scratch is None or peer.epoch != task.read.epoch:
                self._claim_instead(fence, now, "the producer was hand-shaken with again")
                return
            try:
                plan = plan_blocks(peer.words, task.remote_block_ids, self._scratch.layout, task.local_block_ids)
                self._scratch.reset(task.local_block_ids)
                fence.words = self._transport.post_read(peer.agent_name, plan, b"")
                fence.step, fence.words_posted_at = FenceStep.READING_WORDS, now
            except KVConnectorError as e:
                self._claim_instead(fence, now, f"could not read the lease words: {e}")
                return
        try:
            state = self._transport.poll(fence.words)
        except KVConnectorError as e:
            self._end_words(fence)  # a words read lands in our scratch only: settled or not, it proves nothing
            self._claim_instead(fence, now, f"reading the lease words failed: {e}")
            return
        if state is not XferState.DONE:
            return  # the transfer deadline bounds it
        self._end_words(fence)
        assert self._scratch is not None
        if self._scratch.all_equal(lease_word(task.read.epoch, task.remote_request_id), task.local_block_ids):
            fence.step = FenceStep.PROVED  # the bytes were read under the live lease
            task.claim_s = now - fence.words_posted_at
            self.fenced_by_words += 1
        else:
            self._claim_instead(fence, now, "the lease words do not prove the lease live")

    def _end_words(self, fence: Fence) -> None:
        if fence.words is not None:
            self._transport.release(fence.words)
            fence.words = None

    @staticmethod
    def _claim_instead(fence: Fence, now: float, why: str) -> None:
        logger.debug("%s; claiming the lease", why)
        fence.step, fence.due_at = FenceStep.CLAIM_DUE, now  # queued by _advance_claim, sent at the end of this progress call

    def _advance_claim(self, task: RecvTask, fence: Fence, now: float) -> None:
        if fence.step is FenceStep.CLAIM_DUE:
            if now >= fence.due_at:
                fence.step = FenceStep.CLAIM_QUEUED  # sent at the end of this progress call
                self._to_claim.setdefault(task.peer_key, []).append(task)
            return
        if fence.step is not FenceStep.CLAIMING:
            return
        batch = fence.batch
        assert batch is not None
        if not batch.future.done():
            return  # the side-channel request has its own deadline
        fence.batch = None
        try:
            reply = batch.future.result()
            if not isinstance(reply, wire.ClaimReply):
                raise PeerProtocolError(f"unexpected answer {type(reply).__name__}")
            i = batch.index[task.key]
            result, reason = ClaimResult(reply.results[i]), reply.reasons[i]
        except Exception as e:  # boundary: a failed claim fails this request, never the step
            self._fail(task, FailReason.FENCE, StaleReadError(f"could not claim the producer's lease: {e}"))
            return
        if result is ClaimResult.GRANTED:
            fence.step, fence.hold_until = FenceStep.GRANTED, batch.sent_at + reply.hold_s * _FENCE_MARGIN
            task.claim_s = now - batch.sent_at
        elif result is ClaimResult.PENDING and now < fence.claim_deadline:
            fence.step, fence.due_at = FenceStep.CLAIM_DUE, now + _CLAIM_RETRY_S
        else:
            self.claims_refused += 1
            peer = self._producers.get(task.peer_key)
            if reply.epoch != peer.epoch:
                peer.error = "the producer restarted"  # the next request hand-shakes with the new process
            why = (
                reason
                if result is not ClaimResult.PENDING
                else (
                    f"the producer does not hold request {task.remote_request_id} "
                    f"(unknown after {self._cfg.handshake_timeout_s:g} s)"
                )
            )
            self._fail(
                task,
                FailReason.FENCE,
                StaleReadError(f"refused a stale read: {why}; its blocks may hold another prompt's KV now"),
            )

    # idle pacing ------------------------------------------------------------------------------
    @staticmethod
    def polling(task: RecvTask) -> bool:
        """Something only polling sees is awaited: the read or words read in flight, a claim due."""
        read, fence = task.read, task.fence
        if read is None or fence is None:
            return False
        return read.step is not ReadStep.LANDED or fence.step in (FenceStep.READING_WORDS, FenceStep.CLAIM_DUE)

    @staticmethod
    def awaiting(task: RecvTask) -> bool:
        """A claim's answer is on its way."""
        return task.fence is not None and task.fence.step is FenceStep.CLAIMING

    @staticmethod
    def in_flight(task: RecvTask) -> list[object]:
        """The transport ops of this task that may still move bytes (the data read, the words read)."""
        handles: list[object] = []
        if task.read is not None and task.read.step is ReadStep.IN_FLIGHT:
            handles.append(task.read.handle)
        if task.fence is not None and task.fence.words is not None:
            handles.append(task.fence.words)
        return handles
