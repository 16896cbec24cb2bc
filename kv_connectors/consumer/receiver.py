"""D side of a transfer: the receive tasks, advanced through their phases (consumer.tasks) by the
pull, push and settling parts, and reported to vLLM once they ended."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from kv_connectors import sidechannel, wire
from kv_connectors.config import ConnectorConfig, TransferMode
from kv_connectors.consumer.producers import Producers
from kv_connectors.consumer.pull import Pull
from kv_connectors.consumer.push import PushLoads
from kv_connectors.consumer.renewer import LoadHeartbeats, Renewer
from kv_connectors.consumer.tasks import FailReason, RecvFailure, RecvKind, RecvPhase, RecvTask, TaskKey
from kv_connectors.counters import DURATIONS_CAP, Phase
from kv_connectors.errors import KVConnectorError, PeerDisconnectedError
from kv_connectors.fence import LeaseWords
from kv_connectors.layout import KVLayout
from kv_connectors.logutil import RateLimitedLog
from kv_connectors.transports.base import Transport

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)


@dataclasses.dataclass
class RecvTotals:
    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    blocks: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    settled: int = 0  # failed loads that had to settle (an operation in flight) before they were reported
    durations: list[float] = dataclasses.field(default_factory=list)  # each load's, until taken for metrics
    phases: dict[Phase, list[float]] = dataclasses.field(default_factory=dict)  # likewise, per phase


def _ended_disconnected(transport: Transport, handle: object) -> str | None:
    """Why a settled transfer's connection is broken, if it ended so. A read given up on may end
    after UCX gave up on its connection (a link cut while it waited): later reads over that
    connection would fail as well, so the next request handshakes again instead."""
    try:
        transport.poll(handle)
    except PeerDisconnectedError as e:
        return str(e)
    except KVConnectorError:
        pass
    return None


class Receiver:
    """Owns D's receive tasks. Transport calls happen on the caller's thread; the side-channel
    client's threads only do side-channel I/O (handshakes, claims, push requests, aborts)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        transport: Transport,
        layout: KVLayout,
        producers: Producers,
        *,
        client: sidechannel.Client,
        clock: Callable[[], float],
        scratch: LeaseWords | None = None,  # where producers' lease words are read to (None: always claim)
        renewer: Renewer | None = None,  # heartbeats for loads that wait (None: only queued requests get them)
    ) -> None:
        self._cfg = cfg
        self._rank = rank
        self._clock = clock
        self._transport = transport
        self._layout = layout
        self._hash = producers.hash
        self.producers = producers
        self._pull = Pull(
            cfg,
            rank,
            transport,
            layout,
            self.producers,
            clock=clock,
            scratch=scratch,
            fail=self.fail_transfer,
            complete=self._complete,
            notify=self._notify_quietly,
        )
        self._push = PushLoads(
            cfg,
            rank,
            transport.name,
            layout,
            self.producers,
            client=client,
            clock=clock,
            complete=self._complete,
            settle_failed=self._settled,
        )
        self._tasks: dict[TaskKey, RecvTask] = {}
        self._heartbeats = LoadHeartbeats(renewer, cfg.lease_renew_after_s) if renewer is not None else None
        self._group_failed: set[str] = set()  # requests read from several producer ranks: one read failed
        self.totals = RecvTotals()

    @property
    def claims_refused(self) -> int:
        return self._pull.claims_refused

    @property
    def fenced_by_words(self) -> int:
        return self._pull.fenced_by_words

    # intake -----------------------------------------------------------------------------------
    def add(self, task: RecvTask) -> None:
        self._tasks[task.key] = task
        if task.phase is RecvPhase.HANDSHAKE:
            self.producers.ensure(task.peer_key, task.remote_rank, task.remote_tp_size)

    # progress ---------------------------------------------------------------------------------
    def progress(self) -> None:
        self.producers.resolve()
        now = self._clock()
        for task in self._tasks.values():
            self._advance_safely(task, now)
        self._pull.send_claims()
        self._pull.post(lambda task: self._advance_safely(task, self._clock()))
        self._pull.send_claims()  # the claims of reads whose words proved nothing
        if self._heartbeats is not None:
            self._heartbeats.keep(self._tasks, self._clock())

    def _advance_safely(self, task: RecvTask, now: float) -> None:
        try:
            self._advance(task, now)
        except Exception as e:  # boundary: a bug or a peer's bad bytes fail this request, never the step
            logger.exception("request %s: unexpected error", task.request_id)
            self.fail_transfer(task, FailReason.INTERNAL, KVConnectorError(f"internal error: {type(e).__name__}: {e}"))

    def _advance(self, task: RecvTask, now: float) -> None:
        phase = task.phase
        if phase is RecvPhase.HANDSHAKE:
            self._advance_handshake(task, now)
        elif phase is RecvPhase.READING:
            self._pull.advance(task, now)
        elif phase in (RecvPhase.PUSH_REQUESTED, RecvPhase.AWAITING_WRITE) or (phase is RecvPhase.SETTLING and task.push):
            self._push.advance(task, now)
        elif phase is RecvPhase.SETTLING:
            self._advance_settling(task, now)

    def _advance_handshake(self, task: RecvTask, now: float) -> None:
        peer = self.producers.get(task.peer_key)
        if peer.error is not None:
            task.fail(FailReason.HANDSHAKE, f"handshake with producer failed: {peer.error}")
        elif peer.layout is None:
            if now > task.deadline:
                task.fail(FailReason.HANDSHAKE, "handshake with producer timed out")
        else:
            if peer.connected_at >= task.created:  # this load waited on the handshake
                task.handshake_waits = peer.waits()
            if self._cfg.mode is TransferMode.PUSH or not task.local_block_ids or not task.remote_block_ids:
                self._push.start(task)  # P's blocks unknown (transfer-id flow): only P can move them
            else:
                self._pull.start(task, peer)

    def busy(self) -> bool:
        """Any load or release under way."""
        return bool(self._tasks)

    def polling(self) -> bool:
        """Something only polling sees is awaited: a posted read in flight, P's write (push: its
        notification), a claim or an abort due, an operation settling."""
        for task in self._tasks.values():
            if self._pull.polling(task) or self._push.polling(task):
                return True
            if task.phase is RecvPhase.SETTLING and task.settle is not None and task.settle.handles:
                return True
        return False

    def awaiting(self) -> bool:
        """An answer from a producer's side channel is on its way (its arrival wakes the engine's
        idle wait): a handshake, a claim, a push request's acknowledgement, an abort's answer."""
        if self.producers.awaiting():
            return True
        return any(self._pull.awaiting(task) or self._push.awaiting(task) for task in self._tasks.values())

    def on_done_notice(self, request_id: str, error: str, runs: int = 0, attempt: str = "") -> bool:
        """P's notification that it wrote (or failed to write) a push request's blocks.

        False if the notice is not for one of our receive tasks (then it is for our sender)."""
        task = self._tasks.get((RecvKind.LOAD, request_id))
        if task is None or task.phase in (RecvPhase.HANDSHAKE, RecvPhase.DONE, RecvPhase.FAILED):
            return False
        if task.push is None:  # a read of ours: only its own completion (and fence) counts it, never a message
            _limited.warning("notice", "ignored a push notice for request %s, which reads its blocks", request_id)
            return True
        if attempt and attempt != task.push.attempt:  # for an earlier task of that request id
            _limited.warning("notice", "ignored a push notice for request %s of another attempt", request_id)
            return True
        self._push.on_notice(task, error, runs)
        return True

    # failing and settling -----------------------------------------------------------------------
    def fail_transfer(self, task: RecvTask, reason: FailReason, error: Exception) -> None:
        """The load failed. Its operations still in flight are aborted (what the engine can stop) and
        the task settles: reported only once none of them can move a byte into our blocks."""
        if task.push is not None and task.phase in (RecvPhase.PUSH_REQUESTED, RecvPhase.AWAITING_WRITE):
            self._push.give_up(task, RecvFailure(reason, f"KV transfer failed: {error}", error), self._clock())
            return
        handles = self._pull.in_flight(task)
        peer = self.producers.find(task.peer_key)
        if isinstance(error, PeerDisconnectedError) and peer is not None:
            peer.error = str(error)  # the next request handshakes again
        elif peer is not None and peer.agent_name:
            self._notify_quietly(peer.agent_name, task.remote_request_id)  # P may free its blocks: we only read them
        failure = RecvFailure(reason, f"KV transfer failed: {error}", error)
        for handle in handles:
            self._transport.abort(handle)
        for handle in [h for h in handles if self._transport.settled(h)]:  # stopped by the abort, or already over
            self._transport.release(handle)
            handles.remove(handle)
        if not handles:
            task.fail(failure.reason, failure.message, failure.cause)
            return
        task.begin_settling(failure, self._clock(), self._cfg.settle_timeout_s, handles)
        self._advance_settling(task, self._clock())

    def _advance_settling(self, task: RecvTask, now: float) -> None:
        settle = task.settle
        assert settle is not None
        for handle in list(settle.handles):
            if self._transport.settled(handle):
                if (broken := _ended_disconnected(self._transport, handle)) is not None:
                    self.producers.mark_failed(task.peer_key, broken)  # the next request connects anew
                self._transport.release(handle)
                settle.handles.remove(handle)
        if not settle.handles:
            self._settled(task, settle.failure)
        elif settle.quarantine_due(now):
            logger.error(
                "request %s: its failed transfer from %s:%d has not ended after %.0f s; its blocks stay held "
                "until the transport says no byte of it can land",
                task.request,
                task.peer_key.host,
                task.peer_key.port,
                now - settle.since,
            )

    def _settled(self, task: RecvTask, failure: RecvFailure) -> None:
        settle = task.settle
        if settle is not None:
            self.totals.settled += 1
            self._keep(Phase.SETTLE, self._clock() - settle.since)
        task.fail(failure.reason, failure.message, failure.cause)

    def settling(self) -> tuple[int, int, int]:
        """(tasks settling, of which quarantined (past their settle deadline), bytes those hold)."""
        settling = [t for t in self._tasks.values() if t.phase is RecvPhase.SETTLING and t.settle is not None]
        stuck = [t for t in settling if t.settle is not None and t.settle.quarantined]
        return len(settling), len(stuck), sum(len(t.local_block_ids) * self._layout.block_bytes for t in stuck)

    def _notify_quietly(self, agent_name: str, remote_request_id: str) -> None:
        """Tell P to free its blocks after a read (or a failed one); P's lease covers a lost notice."""
        try:
            msg = wire.encode(wire.TransferDone(remote_request_id, self._cfg.engine_id, rank=self._rank), self._hash)
            self._transport.send_notif(agent_name, msg)
        except KVConnectorError as e:
            logger.debug("could not notify producer %s: %s", agent_name, e)

    # completion ---------------------------------------------------------------------------------
    def _keep(self, phase: Phase, seconds: float) -> None:
        kept = self.totals.phases.setdefault(phase, [])
        if len(kept) < DURATIONS_CAP:
            kept.append(seconds)

    def _complete(self, task: RecvTask) -> None:
        now = self._clock()
        phases = task.phases(now)
        task.phase = RecvPhase.DONE
        task.settle = None
        elapsed = now - task.started
        t = self.totals
        t.transfers += 1
        t.bytes += task.num_bytes
        t.blocks += len(task.local_block_ids)
        t.descriptors += task.num_descriptors
        t.seconds += elapsed
        if len(t.durations) < DURATIONS_CAP:
            t.durations.append(elapsed)
        for phase, seconds in phases.items():
            self._keep(phase, seconds)
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

    # results ----------------------------------------------------------------------------------
    def take_finished(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; releases are not reported. A task
        still settling is not: vLLM keeps its blocks until it is (kv_connectors.consumer.tasks)."""
        finished: set[str] = set()
        failed: set[str] = set()
        ended = [key for key, t in self._tasks.items() if t.ended]
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
                continue  # another producer rank's heads are still on their way (or settling)
            finished.add(rid)
            if rid in self._group_failed:
                self._group_failed.discard(rid)
                failed.add(rid)
        if ended:
            names = {task.peer_key for task in self._tasks.values()}
            self.producers.prune(names.__contains__)
        return finished, failed

    def close(self) -> None:
        for task in self._tasks.values():
            handles = self._pull.in_flight(task) + (task.settle.handles if task.settle is not None else [])
            for handle in handles:
                self._transport.release(handle)
        self._tasks.clear()
        self.producers.close()
