"""The Mooncake transport's thread per peer: its jobs in order, batch by batch, failures told apart by probing the peer."""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from types import ModuleType
from typing import Any

import numpy as np

from kv_connectors.errors import PeerDisconnectedError, TransferTimeoutError, TransportError
from kv_connectors.mooncake.metadata import PeerInfo
from kv_connectors.mooncake.xfer import MooncakeXfer
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import Op, XferState
from kv_connectors.transports.intervals import Ranges

logger = logging.getLogger(__name__)

_NO_SEGMENT = (1 << 64) - 1  # batch id returned by batch_transfer_async_* when the peer cannot be opened
_PROBE_TIMEOUT_S = 1.0
_SLOW_FAILURE_S = 5.0  # the engine's transfer timeout is >= 5 s: a later failure of a live peer timed out
# get_batch_transfer_status spins a core until the batch ends, starving the engine's own TCP threads
# on small hosts: a peer thread first sleeps this fraction of the batch's expected time (from the
# speed seen for runs of that size): ~1.5x the scattered-block throughput on 2 cores.
_NAP_FRACTION = 0.8
_MIN_NAP_S = 0.0002
_MAX_NAP_S = 1.0


def reachable(session_id: str) -> bool:
    """Whether the peer's handshake port still accepts TCP connections (asked twice: a peer being
    killed may hold its listening socket a moment longer than its transfers)."""
    host, _, port = session_id.rpartition(":")
    try:
        for pause in (0.2, 0.0):
            socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S).close()
            time.sleep(pause)
    except OSError:
        return False
    return True


class PeerWorker:
    """One thread per peer: runs its jobs in order, batch by batch (the engine's wait spins a core)."""

    def __init__(
        self,
        owner: str,
        engine: Any,
        mc: ModuleType,
        peer_name: str,
        info: PeerInfo,
        scratch: np.ndarray,
        max_batch: int,
        metadata: bytes,
        watch: Any = None,
    ) -> None:
        self.peer_name = peer_name
        self._watch = watch  # called with a job whose failed batch may still move bytes
        self.info = info
        self.ranges = Ranges(info.ranges)  # what the peer registered, for checking its side of our plans
        self.metadata = metadata  # exactly what connect() got: equal bytes mean the same peer incarnation
        self._owner = owner
        self._engine = engine
        self._mc = mc
        self._scratch_buf = scratch  # kept alive while an engine call may still use it
        self._scratch = int(scratch.ctypes.data)
        self._max_batch = max_batch
        self._speed: dict[int, float] = {}  # bytes/s of finished batches, by run-size class
        self._cv = threading.Condition()
        self._jobs: collections.deque[MooncakeXfer] = collections.deque()
        self._stop_reason: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"mooncake-{owner}-{peer_name}", daemon=True)
        self.thread.start()

    def submit(self, job: MooncakeXfer) -> None:
        with self._cv:
            if self._stop_reason is not None:
                raise TransportError(f"Mooncake peer {self.peer_name!r}: {self._stop_reason}")
            self._jobs.append(job)
            self._cv.notify()

    def stop(self, reason: str) -> None:
        """Fail queued jobs; the running one stops after its current batch. Does not wait."""
        with self._cv:
            self._stop_reason = reason
            pending = list(self._jobs)
            self._jobs.clear()
            self._cv.notify()
        for job in pending:
            self._fail(job, PeerDisconnectedError(f"{job.op} with {self.peer_name}: {reason}"))

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._stop_reason is not None)
                if self._stop_reason is not None:
                    return
                job = self._jobs.popleft()
            try:
                self._execute(job)
            except TransportError as e:
                self._fail(job, e)
            except Exception as e:  # a bug or an engine surprise must not kill the thread silently
                self._fail(job, TransportError(f"{job.op} with {self.peer_name}: {type(e).__name__}: {e}"))

    def _fail(self, job: MooncakeXfer, err: TransportError) -> None:
        if job._state is not XferState.DONE and job._error is None:
            job._error = err
        if not job._in_engine:
            job._ended = True  # failed before or between batches, or its peer is gone
        elif self._watch is not None:
            job._session = self.info.session_id
            self._watch(job)  # settled once the peer's process is gone (see MooncakeTransport)
        if job._quiet:
            logger.warning("Mooncake %s: notification to %s failed: %s", self._owner, self.peer_name, err)

    def _execute(self, job: MooncakeXfer) -> None:
        plan = job._plan
        batches = plan.split(self._max_batch) if plan is not None and plan.num_runs else []
        for i, sub in enumerate(batches):
            self._check_going(job, f"after {i} of {len(batches)} batches")
            self._run_batch(job, sub)
        if job._notif is not None:
            self._check_going(job, "before its notification")
            # The engine sends a notify only with a synchronous transfer, once that completed (so after
            # all our batches): read one byte of the peer's scratch to carry it.
            started = time.monotonic()
            rc = self._engine.batch_transfer_sync(
                self.info.session_id,
                [self._scratch],
                [self.info.scratch_addr],
                [1],
                self._mc.TransferOpcode.Read,
                self._mc.TransferNotify(self._owner, job._notif),
            )
            if rc != 0:
                raise self._failure(job, "notification", f"rc {rc}", started)
        job._plan = None
        job._state = XferState.DONE
        job._ended = True

    def _check_going(self, job: MooncakeXfer, where: str) -> None:
        if job._cancelled:
            raise TransportError(f"{job.op} with {self.peer_name}: released {where}")
        if self._stop_reason is not None:
            raise PeerDisconnectedError(f"{job.op} with {self.peer_name}: {self._stop_reason} {where}")

    def _run_batch(self, job: MooncakeXfer, sub: TransferPlan) -> None:
        """Submit one batch and wait for it; naps first for most of its expected time (see _NAP_FRACTION)."""
        read = job.op is Op.READ
        local, remote = (sub.dst, sub.src) if read else (sub.src, sub.dst)
        submit = self._engine.batch_transfer_async_read if read else self._engine.batch_transfer_async_write
        nbytes = sub.total_bytes
        size_class = (nbytes // sub.num_runs).bit_length()  # runs of similar size move at similar speed
        started = time.monotonic()
        job._in_engine = True
        batch_id = submit(self.info.session_id, local.tolist(), remote.tolist(), sub.length.tolist())
        if batch_id in (_NO_SEGMENT, 0):
            job._in_engine = False  # nothing was submitted
        if batch_id == _NO_SEGMENT:
            raise PeerDisconnectedError(
                f"Mooncake {job.op} with {self.peer_name}: cannot open its segment {self.info.session_id} (peer unreachable)"
            )
        if batch_id == 0:
            raise self._failure(job, f"submitting a batch of {sub.num_runs} runs", "batch id 0", started)
        speed = self._speed.get(size_class)
        nap = 0.0 if speed is None else _NAP_FRACTION * nbytes / speed
        if nap >= _MIN_NAP_S:
            time.sleep(min(nap, _MAX_NAP_S))
        rc = self._engine.get_batch_transfer_status([batch_id])  # busy-waits until done or failed
        if rc != 0:
            raise self._failure(job, f"batch of {sub.num_runs} runs", f"rc {rc}", started)
        job._in_engine = False
        seen = nbytes / max(time.monotonic() - started, 1e-6)
        # Leans to the fastest recent speed, so a nap rarely outlasts the batch.
        self._speed[size_class] = seen if speed is None else max(seen, (speed + seen) / 2)

    def _failure(self, job: MooncakeXfer, what: str, code: str, started: float) -> TransportError:
        """Mooncake says only -1: tell a dead peer from a timeout or a refused request by probing it."""
        elapsed = time.monotonic() - started
        sid = self.info.session_id
        prefix = f"Mooncake {job.op} with {self.peer_name} ({sid}): {what} failed, {code} after {elapsed:.2f} s"
        if not reachable(sid):
            job._in_engine = False  # its process is gone: nothing more of the batch can arrive
            return PeerDisconnectedError(f"{prefix}; the peer is gone (its port refuses connections)")
        if elapsed >= _SLOW_FAILURE_S:
            return TransferTimeoutError(f"{prefix}; the peer is reachable but did not answer in time (frozen?)")
        return TransportError(
            f"{prefix}; the peer is alive (address outside its registered memory, queue full, or a transient error)"
        )
