"""D side of a transfer: handshakes with producers, then pulls (READ) or asks P to push (WRITE), with deadlines."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig, TransferMode
from kv_connectors.counters import DURATIONS_CAP, Phase
from kv_connectors.errors import KVConnectorError, PeerDisconnectedError
from kv_connectors.fence import WORD_BYTES, LeaseWords, lease_word, words_layout
from kv_connectors.layout import KVLayout
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.plan import BlockTable, TransferPlan, plan_blocks, plan_cells
from kv_connectors.state import ClaimBatch, ClaimResult, FailReason, RecvKind, RecvPhase, RecvTask, TaskKey
from kv_connectors.transports.base import Transport, XferState

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)

PeerKey = tuple[str, str, int]  # (engine id or "" for any, side-channel host, port)
_CLAIM_RETRY_S = 0.02  # P's worker has not added the lease yet (it does at its next step): ask again
_FENCE_MARGIN = 0.95  # of P's hold: clocks on two hosts may run at slightly different rates


@dataclasses.dataclass
class _Peer:
    """A producer: known once its handshake answered."""

    future: concurrent.futures.Future[wire.Body] | None
    agent_name: str = ""
    layout: KVLayout | None = None
    error: str | None = None
    epoch: str = ""  # the producer process the cached handshake came from
    words: KVLayout | None = None  # its lease words (kv_connectors.fence), where it has them and we read them


@dataclasses.dataclass
class RecvTotals:
    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    blocks: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    durations: list[float] = dataclasses.field(default_factory=list)  # each load's, until taken for metrics
    phases: dict[Phase, list[float]] = dataclasses.field(default_factory=dict)  # likewise, per phase


class Receiver:
    """Owns D's receive tasks. Transport calls happen on the caller's thread; the pool thread
    only does side-channel I/O (handshakes, push requests)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        tp_size: int,
        transport: Transport,
        layout: KVLayout,
        compat: wire.CompatInfo,
        *,
        client: sidechannel.Client,
        clock: Callable[[], float],
        local_metadata: bytes,  # the transport's, read once at registration
        scratch: LeaseWords | None = None,  # where producers' lease words are read to (None: always claim)
    ) -> None:
        self._cfg = cfg
        self._scratch = scratch
        self._local_metadata = local_metadata
        self._rank = rank
        self._tp_size = tp_size
        self._client = client
        self._clock = clock
        self._transport = transport
        self._layout = layout
        self._compat = compat
        self._hash = compat.hash()
        self._peers: dict[PeerKey, _Peer] = {}
        self._expected: dict[PeerKey, tuple[int, int]] = {}  # the (rank, TP size) a producer must answer as
        self._tasks: dict[TaskKey, RecvTask] = {}
        self._to_claim: dict[PeerKey, list[RecvTask]] = {}
        self._reads: list[tuple[RecvTask, _Peer, TransferPlan]] = []  # planned and claimed, to post
        self._group_failed: set[str] = set()  # requests read from several producer ranks: one read failed
        self.totals = RecvTotals()
        self.claims_refused = 0
        self.fenced_by_words = 0

    def _submit(self, key: PeerKey, body: wire.Body) -> concurrent.futures.Future[wire.Body]:
        """One side-channel request to the producer at key (off this thread, with its own deadline)."""
        _engine, host, port = key
        return self._client.submit(host, port, body, self._hash, self._cfg.handshake_timeout_s)

    # intake -----------------------------------------------------------------------------------
    def add(self, task: RecvTask) -> None:
        self._tasks[task.key] = task
        if task.phase is RecvPhase.HANDSHAKE:
            self._expected[task.peer_key] = (task.remote_rank, task.remote_tp_size)
            self._ensure_peer(task.peer_key)

    def _ensure_peer(self, key: PeerKey) -> None:
        peer = self._peers.get(key)
        if peer is not None and peer.error is None:
            return
        # P connects back to us: it writes into our blocks (push) and a staged transport answers
        # our reads with notifications.
        request = wire.HandshakeRequest(
            self._cfg.engine_id,
            self._rank,
            self._compat,
            agent_name=self._transport.name,
            agent_metadata=self._local_metadata,
            layout=wire.LayoutMsg.from_layout(self._layout),
            tp_size=self._tp_size,
        )
        self._peers[key] = _Peer(self._submit(key, request))

    # progress ---------------------------------------------------------------------------------
    def progress(self) -> None:
        self._resolve_peers()
        now = self._clock()
        for task in self._tasks.values():
            self._advance_safely(task, now)
        self._send_claims()
        reads, self._reads = self._reads, []
        for task, peer, plan in reads:
            if task.phase is RecvPhase.TRANSFER:
                self._post_read(task, peer, plan)
                if task.words_pending and task.phase is RecvPhase.TRANSFER:
                    # An engine that copied inside the post (NIXL over cma) is done: the words now.
                    self._advance_safely(task, self._clock())
        self._send_claims()  # the claims of reads whose words proved nothing

    def _advance_safely(self, task: RecvTask, now: float) -> None:
        try:
            self._advance(task, now)
        except Exception as e:  # boundary: a bug or a peer's bad bytes fail this request, never the step
            logger.exception("request %s: unexpected error", task.request_id)
            self._fail_transfer(task, FailReason.INTERNAL, KVConnectorError(f"internal error: {type(e).__name__}: {e}"))

    def _advance(self, task: RecvTask, now: float) -> None:
        if task.phase is RecvPhase.HANDSHAKE:
            self._advance_handshake(task, now)
        elif task.phase is RecvPhase.REQUESTED:
            self._advance_request(task, now)
        elif task.phase is RecvPhase.TRANSFER and task.fenced:
            self._advance_read(task, now)
        elif task.phase is RecvPhase.TRANSFER:
            self._advance_transfer(task, now)

    def busy(self) -> bool:
        """Any load or release under way."""
        return bool(self._tasks)

    def polling(self) -> bool:
        """Something only polling sees is awaited: a posted read in flight, P's write (push: its
        notification), or the time to ask again for a claim P answered "pending"."""
        for task in self._tasks.values():
            if task.phase is not RecvPhase.TRANSFER:
                continue
            if task.xfer is not None or task.words_xfer is not None or not task.fenced:
                return True
            if task.claim is None and task.fence_deadline is None:
                return True
        return False

    def awaiting(self) -> bool:
        """An answer from a producer's side channel is on its way (its arrival wakes the engine's
        idle wait): a handshake, a claim, a push request's acknowledgement."""
        if any(peer.future is not None for peer in self._peers.values()):
            return True
        return any(task.claim is not None or task.ack is not None for task in self._tasks.values())

    def on_done_notice(self, request_id: str, error: str, runs: int = 0) -> bool:
        """P's notification that it wrote (or failed to write) a push request's blocks.

        False if the notice is not for one of our receive tasks (then it is for our sender)."""
        task = self._tasks.get((RecvKind.LOAD, request_id))
        if task is None or task.phase not in (RecvPhase.REQUESTED, RecvPhase.TRANSFER):
            return False
        if task.fenced:  # a read of ours: only its own completion (and fence) counts it, never a message
            _limited.warning("notice", "ignored a push notice for request %s, which reads its blocks", request_id)
            return True
        if task.ack is not None:
            task.ack.cancel()  # the ack may still be in flight; the notice settles it
            task.ack = None
        if error:
            task.fail(FailReason.PRODUCER_WRITE, f"producer could not write the blocks: {error}")
        else:
            task.num_descriptors = runs
            self._complete(task)
        return True

    def _resolve_peers(self) -> None:
        for key, peer in self._peers.items():
            if peer.future is None or not peer.future.done():
                continue
            future, peer.future = peer.future, None
            try:
                reply = future.result()
                if not isinstance(reply, wire.HandshakeReply) or (key[0] and reply.engine_id != key[0]):
                    raise KVConnectorError(
                        f"side channel {key[1]}:{key[2]} answered for engine {getattr(reply, 'engine_id', '?')}, expected {key[0]}"
                    )
                expected = self._expected.get(key, (self._rank, self._tp_size))
                if (reply.rank, reply.tp_size) != expected:
                    raise KVConnectorError(
                        f"side channel {key[1]}:{key[2]} is rank {reply.rank} of tensor_parallel_size {reply.tp_size}; "
                        f"this decode rank {self._rank} of {self._tp_size} expected the prefill's rank {expected[0]} "
                        f"of {expected[1]} there"
                    )
                self._transport.connect(reply.agent_name, reply.agent_metadata)
                peer.agent_name, peer.layout, peer.epoch = reply.agent_name, reply.layout.to_layout(), reply.epoch
                peer.words = self._peer_words(reply, peer.layout)
                logger.info("connected to producer %s at %s:%d", key[0], key[1], key[2])
            except Exception as e:  # boundary: a failed handshake fails requests, never the step
                peer.error = str(e)
                logger.error("handshake with %s at %s:%d failed: %s", key[0], key[1], key[2], e)

    def _peer_words(self, reply: wire.HandshakeReply, layout: KVLayout) -> KVLayout | None:
        """The producer's lease words as a layout, if it has them, we read them, and the address
        it gave can be planned (a peer's bytes: a bad one costs it the one-sided fence, nothing else)."""
        base = reply.lease_words
        if self._scratch is None or not base:
            return None
        if not 0 < base < wire.MAX_ADDRESS - layout.num_blocks * WORD_BYTES:
            logger.warning("producer %s gave lease words at %#x: ignored, its reads are claimed", reply.engine_id, base)
            return None
        return words_layout(base, layout.num_blocks)

    def _advance_handshake(self, task: RecvTask, now: float) -> None:
        peer = self._peers[task.peer_key]
        if peer.error is not None:
            task.fail(FailReason.HANDSHAKE, f"handshake with producer failed: {peer.error}")
        elif peer.layout is None:
            if now > task.deadline:
                task.fail(FailReason.HANDSHAKE, "handshake with producer timed out")
        elif self._cfg.mode is TransferMode.PUSH or not task.local_block_ids or not task.remote_block_ids:
            self._request_push(task)  # P's blocks unknown (transfer-id flow): only P can move them
        elif (plan := self._prepare_read(task, peer)) is not None:
            self._reads.append((task, peer, plan))  # posted after this progress call's claims are sent

    def _request_push(self, task: RecvTask) -> None:
        """Ask P to write (push mode), or just to free its blocks (nothing to read)."""
        request = wire.PushRequest(
            producer_request_id=task.remote_request_id,
            consumer_engine_id=self._cfg.engine_id,
            consumer_agent=self._transport.name,
            consumer_request_id=task.request_id,
            block_ids=list(task.local_block_ids),
            consumer_rank=self._rank,
            first_token=task.first_token,
            num_tokens=task.num_tokens,
            consumer_first_token=task.local_first_token,
            prompt_digest=task.prompt_digest,
        )
        task.ack = self._submit(task.peer_key, request)
        task.phase = RecvPhase.REQUESTED
        task.started = self._clock()
        # Set now: P's notification may complete the task before its acknowledgement is seen.
        task.num_bytes = len(task.local_block_ids) * self._layout.block_bytes

    def _advance_request(self, task: RecvTask, now: float) -> None:
        future = task.ack
        if future is None:
            return
        if not future.done():
            if now > task.deadline:  # the request has its own deadline; this one bounds a stuck client too
                future.cancel()
                task.ack = None
                task.fail(FailReason.PUSH_REQUEST, "the producer did not answer the push request in time")
            return
        task.ack = None
        try:
            ack = future.result()
            peer = self._peers.get(task.peer_key)
            if isinstance(ack, wire.PushAck) and ack.epoch and peer is not None and peer.epoch and ack.epoch != peer.epoch:
                peer.error = "the producer restarted"  # the next request hand-shakes with the new process
                raise KVConnectorError("the producer restarted since the handshake (it cannot reach us until we hand-shake again)")
            if not isinstance(ack, wire.PushAck) or not ack.accepted:
                raise KVConnectorError(f"producer refused: {getattr(ack, 'message', ack)!r}")
        except Exception as e:
            task.fail(FailReason.PUSH_REQUEST, f"push request failed: {e}", e)
            return
        if not task.local_block_ids:
            task.phase = RecvPhase.DONE
            return
        task.phase = RecvPhase.TRANSFER  # no transfer handle: waiting for P's notification
        task.deadline = now + self._cfg.transfer_timeout_s

    def _prepare_read(self, task: RecvTask, peer: _Peer) -> TransferPlan | None:
        """Plan a read and queue its claim on P's lease; the read is posted once the claim is on its
        way (engines may copy inside the post call, as NIXL over cma does: the claim's round trip
        then overlaps the copy instead of following it). None: the plan failed the task.

        The read carries no notification: P learns that D is done only after it granted the claim
        (a notice arriving first would free the lease, and the claim would then be refused)."""
        assert peer.layout is not None
        try:
            plan = self._plan_read(task, peer.layout)
        except KVConnectorError as e:
            self._fail_transfer(task, FailReason.TRANSFER, e)
            return None
        started = self._clock()
        task.phase = RecvPhase.TRANSFER
        task.fenced = True
        task.epoch = peer.epoch  # the producer process read from: its leases alone can prove the read
        task.num_bytes, task.num_descriptors = plan.total_bytes, plan.num_runs
        task.started = started
        task.deadline = started + self._cfg.transfer_timeout_s
        task.claim_deadline = started + self._cfg.handshake_timeout_s
        if peer.words is not None and plan.num_runs > 0 and self._pairs_blocks(task, peer.layout):
            # The words land at our blocks' slots: P's blocks must pair with ours one to one.
            task.words_pending = True  # read once the data read is complete; claimed only if they prove nothing
            task.claim_retry_at = float("inf")
        else:
            self._advance_read(task, started)  # queues the claim
        return plan

    def _post_read(self, task: RecvTask, peer: _Peer, plan: TransferPlan) -> None:
        try:
            task.xfer = self._transport.post_read(peer.agent_name, plan, b"")
        except KVConnectorError as e:
            self._fail_transfer(task, FailReason.TRANSFER, e)

    def _pairs_blocks(self, task: RecvTask, remote: KVLayout) -> bool:
        """P's blocks pair with ours one to one (plan_blocks, which refuses lists of unequal length)."""
        return remote.block_size == self._layout.block_size or not task.num_tokens

    def _plan_read(self, task: RecvTask, remote: KVLayout) -> TransferPlan:
        """Blocks paired one to one where both sides' blocks hold as many tokens; else the task's
        tokens, mapped through both block tables."""
        if self._pairs_blocks(task, remote):
            return plan_blocks(remote, task.remote_block_ids, self._layout, task.local_block_ids)
        return plan_cells(
            remote,
            BlockTable(task.remote_block_ids, task.remote_first_token),
            self._layout,
            BlockTable(task.local_block_ids, task.local_first_token),
            task.first_token,
            task.num_tokens,
        )

    def _send_claims(self) -> None:
        """One ClaimRequest per producer for every read waiting to claim."""
        for key, tasks in self._to_claim.items():
            epoch = self._peers[key].epoch
            for t in tasks:
                if t.phase is RecvPhase.TRANSFER and t.epoch != epoch:  # a new process answers there now
                    self._fail_transfer(t, FailReason.FENCE, KVConnectorError("the producer restarted during the read"))
            tasks = [t for t in tasks if t.phase is RecvPhase.TRANSFER]
            if not tasks:
                continue
            request = wire.ClaimRequest(
                self._cfg.engine_id,
                [wire.ClaimItem(t.remote_request_id, list(t.remote_block_ids)) for t in tasks],
                epoch=epoch,
                consumer_rank=self._rank,
            )
            sent_at = self._clock()
            batch = ClaimBatch(self._submit(key, request), sent_at, {t.key: i for i, t in enumerate(tasks)})
            for t in tasks:
                t.claim = batch
        self._to_claim.clear()

    def _advance_read(self, task: RecvTask, now: float) -> None:
        """Pull: the read counts once it is complete and either P's lease words, read after it, are
        the lease's, or P granted the claim before it could lapse."""
        if task.xfer is not None:
            done = self._poll(task)
            if done is None:
                return
            if done:
                task.read_done_at = now
        if task.read_done_at is not None and task.fence_deadline is None:
            self._advance_words(task, now)
        self._advance_claim(task, now)
        if task.phase is not RecvPhase.TRANSFER:
            return
        if task.read_done_at is not None and task.fence_deadline is not None:
            if task.read_done_at > task.fence_deadline:
                self._fail_transfer(
                    task,
                    FailReason.FENCE,
                    KVConnectorError("the read completed after the producer's hold on its blocks may have ended"),
                )
                return
            self._notify_quietly(self._peers[task.peer_key].agent_name, task.remote_request_id)
            self._complete(task)
            return
        limit = task.deadline if task.fence_deadline is None else min(task.deadline, task.fence_deadline)
        if now > limit:
            self._fail_transfer(task, FailReason.TIMEOUT, KVConnectorError(f"transfer timed out after {now - task.started:.1f} s"))

    def _advance_words(self, task: RecvTask, now: float) -> None:
        """After the data read: read P's lease words for its blocks, then compare them with the
        lease's word. Equal: the lease was live when they were read, after every byte of the data
        (kv_connectors.fence); otherwise (not added yet, ended, shared) claim the lease instead."""
        peer = self._peers[task.peer_key]
        if task.words_pending:
            task.words_pending = False
            if peer.words is None or self._scratch is None or peer.epoch != task.epoch:
                self._claim_instead(task, now, "the producer was hand-shaken with again")
                return
            try:
                plan = plan_blocks(peer.words, task.remote_block_ids, self._scratch.layout, task.local_block_ids)
                self._scratch.reset(task.local_block_ids)
                task.words_xfer = self._transport.post_read(peer.agent_name, plan, b"")
                task.words_posted_at = now
            except KVConnectorError as e:
                self._claim_instead(task, now, f"could not read the lease words: {e}")
                return
        if task.words_xfer is None:
            return
        try:
            state = self._transport.poll(task.words_xfer)
        except KVConnectorError as e:
            self._release_words(task)
            self._claim_instead(task, now, f"reading the lease words failed: {e}")
            return
        if state is not XferState.DONE:
            return  # the transfer deadline bounds it
        self._release_words(task)
        assert self._scratch is not None
        if self._scratch.all_equal(lease_word(task.epoch, task.remote_request_id), task.local_block_ids):
            task.fence_deadline = float("inf")  # proved: the bytes were read under the live lease
            task.claim_s = now - task.words_posted_at
            self.fenced_by_words += 1
        else:
            self._claim_instead(task, now, "the lease words do not prove the lease live")

    def _release_words(self, task: RecvTask) -> None:
        if task.words_xfer is not None:
            self._transport.release(task.words_xfer)
            task.words_xfer = None

    def _claim_instead(self, task: RecvTask, now: float, why: str) -> None:
        logger.debug("request %s: %s; claiming the lease", task.request_id, why)
        task.claim_retry_at = now  # queued by _advance_claim, sent at the end of this progress call

    def _advance_claim(self, task: RecvTask, now: float) -> None:
        if task.fence_deadline is not None:
            return
        batch = task.claim
        if batch is None:
            if now >= task.claim_retry_at:
                task.claim_retry_at = float("inf")  # queued: sent at the end of this progress call
                self._to_claim.setdefault(task.peer_key, []).append(task)
            return
        if not batch.future.done():
            return  # the side-channel request has its own deadline
        task.claim = None
        try:
            reply = batch.future.result()
            if not isinstance(reply, wire.ClaimReply):
                raise KVConnectorError(f"unexpected answer {type(reply).__name__}")
            i = batch.index[task.key]
            result, reason = ClaimResult(reply.results[i]), reply.reasons[i]
        except Exception as e:  # boundary: a failed claim fails this request, never the step
            self._fail_transfer(task, FailReason.FENCE, KVConnectorError(f"could not claim the producer's lease: {e}"))
            return
        if result is ClaimResult.GRANTED:
            task.fence_deadline = batch.sent_at + reply.hold_s * _FENCE_MARGIN
            task.claim_s = now - batch.sent_at
        elif result is ClaimResult.PENDING and now < task.claim_deadline:
            task.claim_retry_at = now + _CLAIM_RETRY_S
        else:
            self.claims_refused += 1
            peer = self._peers.get(task.peer_key)
            if peer is not None and reply.epoch != peer.epoch:
                peer.error = "the producer restarted"  # the next request hand-shakes with the new process
            why = (
                reason
                if result is not ClaimResult.PENDING
                else (
                    f"the producer does not hold request {task.remote_request_id} "
                    f"(unknown after {self._cfg.handshake_timeout_s:g} s)"
                )
            )
            self._fail_transfer(
                task,
                FailReason.FENCE,
                KVConnectorError(f"refused a stale read: {why}; its blocks may hold another prompt's KV now"),
            )

    def _advance_transfer(self, task: RecvTask, now: float) -> None:
        if task.xfer is None:  # push: waiting for P's notification
            if now > task.deadline:
                task.fail(FailReason.TIMEOUT, f"producer did not write the blocks within {self._cfg.transfer_timeout_s:g} s")
            return
        done = self._poll(task)
        if done:
            self._complete(task)
        elif done is False and now > task.deadline:
            self._fail_transfer(
                task, FailReason.TIMEOUT, KVConnectorError(f"transfer timed out after {self._cfg.transfer_timeout_s:g} s")
            )

    def _poll(self, task: RecvTask) -> bool | None:
        """The posted transfer: True once done (handle released), False while in flight, None if it
        failed (then the task has failed)."""
        try:
            state = self._transport.poll(task.xfer)
        except KVConnectorError as e:
            self._fail_transfer(task, FailReason.TRANSFER, e)
            return None
        if state is not XferState.DONE:
            return False
        self._transport.release(task.xfer)
        task.xfer = None
        return True

    def _complete(self, task: RecvTask) -> None:
        task.phase = RecvPhase.DONE
        now = self._clock()
        elapsed = now - task.started
        created = task.started if task.created is None else task.created
        t = self.totals
        t.transfers += 1
        t.bytes += task.num_bytes
        t.blocks += len(task.local_block_ids)
        t.descriptors += task.num_descriptors
        t.seconds += elapsed
        if len(t.durations) < DURATIONS_CAP:
            t.durations.append(elapsed)
        phases = {
            Phase.QUEUE: task.queued_s,
            Phase.HANDSHAKE: max(0.0, task.started - created),
            Phase.READ: (task.read_done_at if task.read_done_at is not None else now) - task.started,
            Phase.TOTAL: now - created,
        }
        if task.claim_s is not None:
            phases[Phase.CLAIM] = task.claim_s
        for phase, seconds in phases.items():
            kept = t.phases.setdefault(phase, [])
            if len(kept) < DURATIONS_CAP:
                kept.append(seconds)
        # One line per transfer, key=value (the phases in ms; transfer = post until the load counted).
        logger.info(
            "kv load request=%s peer=%s:%s:%d remote_request=%s bytes=%d blocks=%d descriptors=%d %s transfer_ms=%.3f",
            task.request_id,
            *task.peer_key,
            task.remote_request_id,
            task.num_bytes,
            len(task.local_block_ids),
            task.num_descriptors,
            " ".join(f"{p.value.removeprefix('load_')}_ms={v * 1e3:.3f}" for p, v in phases.items()),
            elapsed * 1e3,
        )

    def _fail_transfer(self, task: RecvTask, reason: FailReason, error: Exception) -> None:
        if task.ack is not None:
            task.ack.cancel()
            task.ack = None
        if task.xfer is not None:
            self._transport.release(task.xfer)
            task.xfer = None
        self._release_words(task)
        task.claim = None
        peer = self._peers.get(task.peer_key)
        if isinstance(error, PeerDisconnectedError) and peer is not None:
            peer.error = str(error)  # the next request handshakes again
        elif peer is not None and peer.agent_name:
            self._notify_quietly(peer.agent_name, task.remote_request_id)
        task.fail(reason, f"KV transfer failed: {error}", error)

    def _notify_quietly(self, agent_name: str, remote_request_id: str) -> None:
        """Tell P to free its blocks after a failed read; P's lease covers a lost notice."""
        try:
            msg = wire.encode(wire.TransferDone(remote_request_id, self._cfg.engine_id, rank=self._rank), self._hash)
            self._transport.send_notif(agent_name, msg)
        except KVConnectorError as e:
            logger.debug("could not notify producer %s: %s", agent_name, e)

    def _prune_peers(self) -> None:
        """Forget producers that failed and that no task names (addresses come from requests: a
        client naming many dead ones would otherwise keep an entry and a thread for each)."""
        failed = [key for key, peer in self._peers.items() if peer.error is not None]
        if not failed:
            return
        named = {task.peer_key for task in self._tasks.values()}
        for key in failed:
            if key not in named:
                del self._peers[key]
                self._expected.pop(key, None)
                self._client.forget(key[1], key[2])

    # results ----------------------------------------------------------------------------------
    def take_finished(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; releases are not reported."""
        finished: set[str] = set()
        failed: set[str] = set()
        ended = [key for key, t in self._tasks.items() if t.phase in (RecvPhase.DONE, RecvPhase.FAILED)]
        for key in ended:
            task = self._tasks.pop(key)
            rid = task.request
            if task.kind is RecvKind.RELEASE:  # best effort, no load: P's lease frees what it still holds
                if task.phase is RecvPhase.FAILED:
                    logger.warning(
                        "request %s: could not tell the producer to free its blocks (%s); its lease frees them",
                        rid,
                        task.error,
                    )
                continue
            if task.phase is RecvPhase.FAILED:
                self.totals.failures += 1
                logger.error("request %s: %s", rid, task.error)
                self._group_failed.add(rid)
            if task.group and any(t.group == task.group and t.kind is RecvKind.LOAD for t in self._tasks.values()):
                continue  # another producer rank's heads are still on their way
            finished.add(rid)
            if rid in self._group_failed:
                self._group_failed.discard(rid)
                failed.add(rid)
        if ended:
            self._prune_peers()
        return finished, failed

    def close(self) -> None:
        for task in self._tasks.values():
            if task.xfer is not None:
                self._transport.release(task.xfer)
            self._release_words(task)
        self._tasks.clear()
        self._client.close()
