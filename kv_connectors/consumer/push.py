"""D's push: ask P to write its blocks into ours, wait for its notification; on giving up, abort the
request at P and report the load failed only once P confirmed that no write of it can land."""

from __future__ import annotations

import concurrent.futures
import logging
import uuid
from collections.abc import Callable

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig
from kv_connectors.consumer.producers import Producers
from kv_connectors.consumer.tasks import FailReason, Push, RecvFailure, RecvPhase, RecvTask
from kv_connectors.errors import NoAnswerError, PeerProtocolError
from kv_connectors.layout import KVLayout
from kv_connectors.logutil import RateLimitedLog

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)

_ABORT_RETRY_S = 0.05  # P has a write of the request in flight (or did not answer): ask again
_QUARANTINED_RETRY_S = 1.0  # past the settle deadline: ask less often


class PushLoads:
    """Push tasks from PUSH_REQUESTED to DONE, or through SETTLING (the abort) to FAILED."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        agent_name: str,
        layout: KVLayout,
        producers: Producers,
        *,
        client: sidechannel.Client,
        clock: Callable[[], float],
        complete: Callable[[RecvTask], None],
        settle_failed: Callable[[RecvTask, RecvFailure], None],
    ) -> None:
        self._cfg = cfg
        self._rank = rank
        self._agent = agent_name
        self._layout = layout
        self._producers = producers
        self._client = client
        self._clock = clock
        self._complete = complete
        self._settle_failed = settle_failed
        self._gone: dict[tuple[str, int], concurrent.futures.Future[bool]] = {}  # "is P's process gone?" probes

    def start(self, task: RecvTask) -> None:
        """Ask P to write (push mode, or P's blocks unknown: the transfer-id flow), or just to free its
        blocks (nothing to load)."""
        spec = task.spec
        push = Push(attempt=uuid.uuid4().hex)
        request = wire.PushRequest(
            producer_request_id=spec.remote_request_id,
            consumer_engine_id=self._cfg.engine_id,
            consumer_agent=self._agent,
            consumer_request_id=task.request_id,
            block_ids=list(spec.local_block_ids),
            consumer_rank=self._rank,
            # The token range as the wire has it (P's blocks begin at token 0 on P's side).
            first_token=spec.tokens.first,
            num_tokens=spec.tokens.count,
            consumer_first_token=spec.tokens.dst_start,
            prompt_digest=spec.prompt_digest,
            attempt=push.attempt,
            budget_s=self._cfg.transfer_timeout_s,
            group_sizes=list(spec.group_sizes),
        )
        push.ack = self._producers.submit(task.peer_key, request)
        task.push = push
        task.phase = RecvPhase.PUSH_REQUESTED
        task.started = self._clock()
        # Set now: P's notification may complete the task before its acknowledgement is seen.
        task.num_bytes = len(spec.local_block_ids) * self._layout.block_bytes

    def advance(self, task: RecvTask, now: float) -> None:
        if task.phase is RecvPhase.PUSH_REQUESTED:
            self._advance_request(task, now)
        elif task.phase is RecvPhase.AWAITING_WRITE and now > task.deadline:
            why = f"producer did not write the blocks within {self._cfg.transfer_timeout_s:g} s"
            self.give_up(task, RecvFailure(FailReason.TIMEOUT, why), now)
        elif task.phase is RecvPhase.SETTLING:
            self._advance_abort(task, now)

    def _advance_request(self, task: RecvTask, now: float) -> None:
        push = task.push
        assert push is not None and push.ack is not None
        if not push.ack.done():
            if now > task.deadline:  # the request has its own deadline; this one bounds a stuck client too
                push.ack.cancel()
                push.ack = None
                why = "the producer did not answer the push request in time"
                self.give_up(task, RecvFailure(FailReason.PUSH_REQUEST, why), now)
            return
        future, push.ack = push.ack, None
        try:
            ack = future.result()
        except NoAnswerError as e:  # it may have reached P all the same
            self.give_up(task, RecvFailure(FailReason.PUSH_REQUEST, f"push request failed: {e}", e), now)
            return
        except Exception as e:  # P refused it (an error answer): it never queued it
            task.fail(FailReason.PUSH_REQUEST, f"push request failed: {e}", e)
            return
        if not isinstance(ack, wire.PushAck) or not ack.accepted:
            task.fail(FailReason.PUSH_REQUEST, f"push request failed: producer refused: {getattr(ack, 'message', ack)!r}")
            return
        push.epoch = ack.epoch
        peer = self._producers.find(task.peer_key)
        if ack.epoch and peer is not None and peer.epoch and ack.epoch != peer.epoch:
            peer.error = "the producer restarted"  # the next request hand-shakes with the new process
            why = "push request failed: the producer restarted since the handshake (it cannot reach us until we hand-shake again)"
            self.give_up(task, RecvFailure(FailReason.PUSH_REQUEST, why), now)  # that new process queued it
            return
        if not task.local_block_ids:
            task.phase = RecvPhase.DONE
            return
        task.phase = RecvPhase.AWAITING_WRITE  # no transfer handle: waiting for P's notification
        task.deadline = now + self._cfg.transfer_timeout_s

    def on_notice(self, task: RecvTask, error: str, runs: int) -> None:
        """P's notification for this push. P sends a failure only once no write of it is in flight
        (nor can start): the task ends either way, also while settling (a late success is a success)."""
        push = task.push
        if push is not None and push.ack is not None:
            push.ack.cancel()  # the ack may still be in flight; the notice settles it
            push.ack = None
        if push is not None and push.abort is not None:
            push.abort.cancel()
            push.abort = None
        if not error:
            task.num_descriptors = runs
            self._complete(task)
        elif task.phase is RecvPhase.SETTLING and task.settle is not None:
            self._settle_failed(task, task.settle.failure)
        else:
            task.fail(FailReason.PRODUCER_WRITE, f"producer could not write the blocks: {error}")

    # settling: the abort --------------------------------------------------------------------------
    def give_up(self, task: RecvTask, failure: RecvFailure, now: float) -> None:
        """The request may have reached P: P may write into our blocks until it confirms it will not."""
        task.begin_settling(failure, now, self._cfg.settle_timeout_s, [])
        assert task.push is not None
        task.push.abort_at = now
        self._advance_abort(task, now)

    def _advance_abort(self, task: RecvTask, now: float) -> None:
        push, settle = task.push, task.settle
        assert push is not None and settle is not None
        if settle.quarantine_due(now):
            logger.error(
                "request %s: the producer at %s:%d has not confirmed that its write into our blocks ended "
                "(%.0f s): the blocks stay held until it does, restarts or is gone",
                task.request,
                task.peer_key.host,
                task.peer_key.port,
                now - settle.since,
            )
        if push.abort is None:
            if self._producer_gone(task):
                self._settle_failed(task, settle.failure)
            elif now >= push.abort_at:
                body = wire.AbortPush(task.remote_request_id, self._agent, task.request_id, push.attempt)
                push.abort = self._producers.submit(task.peer_key, body)
                push.abort_deadline = now + self._cfg.handshake_timeout_s
            return
        retry = _QUARANTINED_RETRY_S if settle.quarantined else _ABORT_RETRY_S
        if not push.abort.done():
            if now > push.abort_deadline:  # the client's own deadline bounds it too; this one a stuck client
                push.abort.cancel()
                push.abort = None
                self._ask_gone(task)
                push.abort_at = now + retry
                if self._producer_gone(task):
                    self._settle_failed(task, settle.failure)
            return
        future, push.abort = push.abort, None
        try:
            reply = future.result()
            if not isinstance(reply, wire.PushSettled):
                raise PeerProtocolError(f"unexpected answer {type(reply).__name__}")
        except Exception as e:  # no answer (frozen or gone?), or a refusal: ask again, and whether it is gone
            _limited.warning("abort", "request %s: abort of its push not answered: %s", task.request, e)
            self._ask_gone(task)
            push.abort_at = now + retry
            if self._producer_gone(task):  # answered at once (refused: nothing listens there)
                self._settle_failed(task, settle.failure)
            return
        if reply.settled or (push.epoch and reply.epoch and reply.epoch != push.epoch):
            self._settle_failed(task, settle.failure)  # no write can come (or the process that could is gone)
        else:
            push.abort_at = now + retry

    def _ask_gone(self, task: RecvTask) -> None:
        where = task.peer_key.where
        if where not in self._gone:
            self._gone[where] = self._client.listening(*where)

    def _producer_gone(self, task: RecvTask) -> bool:
        """P's side channel refuses connections: its process is gone, and its writes with it."""
        where = task.peer_key.where
        probe = self._gone.get(where)
        if probe is None or not probe.done():
            return False
        del self._gone[where]
        try:
            return probe.result() is False
        except Exception:
            return False

    @staticmethod
    def awaiting(task: RecvTask) -> bool:
        """An answer from P is on its way (the ack, the abort's)."""
        push = task.push
        return push is not None and (push.ack is not None or push.abort is not None)

    @staticmethod
    def polling(task: RecvTask) -> bool:
        """P's notification (only polling sees it), or an abort due."""
        return task.phase in (RecvPhase.AWAITING_WRITE, RecvPhase.SETTLING)
