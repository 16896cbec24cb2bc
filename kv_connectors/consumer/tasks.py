"""D's receive tasks: one request's load (or release) of a producer's blocks, its named phases and sub-steps."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from kv_connectors.counters import Phase
from kv_connectors.specs import ProducerAddress, RecvSpec

if TYPE_CHECKING:
    from kv_connectors.plan import TransferPlan
    from kv_connectors.wire import Body


class RecvKind(enum.Enum):
    """What a D-side task is for."""

    LOAD = "load"  # vLLM waits for it: reported finished (and failed) to vLLM
    # Only tells P to free its blocks (request aborted before it was scheduled, or every block was
    # a local prefix hit): best effort, never reported; P's lease frees what a lost release leaves.
    RELEASE = "release"


class RecvPhase(enum.Enum):
    """Where a D-side task stands. Pull: HANDSHAKE -> READING -> DONE; push: HANDSHAKE ->
    PUSH_REQUESTED -> AWAITING_WRITE -> DONE. A failure with nothing in flight -> FAILED; one that
    may still move bytes into our blocks -> SETTLING -> FAILED once it ended (task.settle)."""

    HANDSHAKE = "handshake"  # waiting for the producer's handshake answer
    PUSH_REQUESTED = "push_requested"  # push: our request is on its way to P (task.push.ack)
    AWAITING_WRITE = "awaiting_write"  # push: P accepted; waiting for its notification
    READING = "reading"  # pull: the read (task.read) under the fence (task.fence)
    SETTLING = "settling"  # failed; reported only once no byte of it can land any more
    DONE = "done"
    FAILED = "failed"


class ReadStep(enum.Enum):
    """Pull: the data read."""

    PLANNED = "planned"  # posted once this progress call's claims are on their way
    IN_FLIGHT = "in_flight"
    LANDED = "landed"  # complete, at Read.landed_at


class FenceStep(enum.Enum):
    """Pull: what proves the read was of the prompt's KV (kv_connectors.fence, SendLeases.claim)."""

    AWAIT_WORDS = "await_words"  # P's lease words are read once the data read landed
    READING_WORDS = "reading_words"  # that read is posted (Fence.words)
    CLAIM_DUE = "claim_due"  # a claim is to be sent at Fence.due_at
    CLAIM_QUEUED = "claim_queued"  # in this progress call's batch to its producer
    CLAIMING = "claiming"  # the claim is on its way (Fence.batch)
    GRANTED = "granted"  # P holds the lease for us until Fence.hold_until (our clock, with a margin)
    PROVED = "proved"  # P's lease words, read after the data, proved the lease live


class FailReason(enum.Enum):
    """Why a D-side task failed."""

    BAD_PARAMS = "bad_params"  # the scheduler side refused the request's kv_transfer_params
    HANDSHAKE = "handshake"  # the producer's side channel refused, failed or did not answer the handshake
    PUSH_REQUEST = "push_request"  # the producer refused or did not answer the push request
    PRODUCER_WRITE = "producer_write"  # the producer reported that its write into our blocks failed
    TRANSFER = "transfer"  # the transport could not post or complete the read
    TIMEOUT = "timeout"  # the read, or the producer's write, did not complete in time
    FENCE = "fence"  # the claim on P's lease was refused or failed, or the read outlived P's hold
    INTERNAL = "internal"  # a bug (or a peer's bytes nothing anticipated) while advancing the task


@dataclasses.dataclass(frozen=True)
class RecvFailure:
    """A failed task: the typed reason, and what is logged for it."""

    reason: FailReason
    message: str
    cause: BaseException | None = None  # the error behind it, where there was one

    def __str__(self) -> str:
        return self.message


TaskKey = tuple[RecvKind, str]  # a load and a release of the same request may coexist


@dataclasses.dataclass
class ClaimBatch:
    """One ClaimRequest to a producer for every read that was ready to claim in one progress call."""

    future: concurrent.futures.Future[Body]
    sent_at: float  # before the request left: at or before P's receipt, so the fence errs early
    index: dict[TaskKey, int]  # task key -> item index


@dataclasses.dataclass
class Read:
    """Pull: the data read of a task, planned against one producer process (epoch)."""

    plan: TransferPlan
    epoch: str
    step: ReadStep = ReadStep.PLANNED
    handle: Any = None  # the transport's, while IN_FLIGHT
    landed_at: float = 0.0


@dataclasses.dataclass
class Fence:
    """Pull: the fence's progress for one read."""

    step: FenceStep
    claim_deadline: float  # P said "pending" (its worker has not added the lease): ask until then
    due_at: float = 0.0  # CLAIM_DUE
    batch: ClaimBatch | None = None  # CLAIMING
    hold_until: float = 0.0  # GRANTED
    words: Any = None  # READING_WORDS: the transport's handle of the words read
    words_posted_at: float = 0.0


@dataclasses.dataclass
class Push:
    """Push: our request to P, and (settling) our abort of it."""

    attempt: str  # names this request at P (its tombstone when aborted): unique per task
    ack: concurrent.futures.Future[Body] | None = None  # PUSH_REQUESTED: P's answer
    epoch: str = ""  # the producer process that accepted it ("": not known)
    abort: concurrent.futures.Future[Body] | None = None  # SETTLING: our abort's answer
    abort_at: float = 0.0  # SETTLING: when to ask (again)
    abort_deadline: float = 0.0  # SETTLING: when the answer in flight counts as lost


@dataclasses.dataclass
class Settle:
    """A failed task whose transfer may still move bytes into our blocks: reported once it ended.

    Pull: until the transport says every op `settled`. Push: until P confirms that no write of the
    request is in flight or can start (or P is known to have restarted)."""

    failure: RecvFailure
    since: float
    deadline: float  # past it: quarantined (counted, logged), still never reported before it ended
    handles: list[Any] = dataclasses.field(default_factory=list)
    quarantined: bool = False

    def quarantine_due(self, now: float) -> bool:
        """True once, when the deadline has passed: the task is quarantined from now on (the caller
        logs why); its blocks stay held until the transfer ended, whatever the deadline."""
        if self.quarantined or now <= self.deadline:
            return False
        self.quarantined = True
        return True


@dataclasses.dataclass
class RecvTask:
    """One request's load of a producer rank's blocks into ours (or release of P's), through its phases."""

    request_id: str  # this task's own id (a request read from several producer ranks has one per rank)
    spec: RecvSpec  # what the scheduler asked for
    deadline: float  # of the current phase
    kind: RecvKind = RecvKind.LOAD
    peer: ProducerAddress | None = None  # the producer rank read from (None: the spec's, rank 0)
    remote_rank: int = 0
    remote_tp_size: int = 1
    group: str = ""  # the request id vLLM knows, where the request is one task per producer rank
    phase: RecvPhase = RecvPhase.HANDSHAKE
    error: RecvFailure | None = None
    read: Read | None = None  # pull, READING
    fence: Fence | None = None  # pull, READING
    push: Push | None = None  # push, from PUSH_REQUESTED
    settle: Settle | None = None  # SETTLING
    # Timings (kv_connectors.counters.Phase): when the load was created and posted, the fence's round trip.
    created: float = 0.0
    started: float = 0.0
    claim_s: float | None = None
    handshake_waits: dict[str, float] | None = None  # the handshake's parts (Producer.waits) where it waited on one
    num_bytes: int = 0
    num_descriptors: int = 0

    @property
    def peer_key(self) -> ProducerAddress:
        return self.spec.peer_key if self.peer is None else self.peer

    @property
    def remote_request_id(self) -> str:
        return self.spec.remote_request_id

    @property
    def local_block_ids(self) -> tuple[int, ...]:
        return self.spec.local_block_ids

    @property
    def remote_block_ids(self) -> tuple[int, ...]:
        return self.spec.remote_block_ids

    @property
    def request(self) -> str:
        """The request id reported to vLLM."""
        return self.group or self.request_id

    @property
    def key(self) -> TaskKey:
        return (self.kind, self.request_id)

    @property
    def ended(self) -> bool:
        return self.phase in (RecvPhase.DONE, RecvPhase.FAILED)

    def phases(self, now: float) -> dict[Phase, float]:
        """The load's phases in seconds (kv_connectors.counters.Phase), done at now."""
        created = self.created or self.started
        read = self.read
        phases = {
            Phase.QUEUE: self.spec.queued_s,
            Phase.HANDSHAKE: max(0.0, self.started - created),
            Phase.READ: (read.landed_at if read is not None and read.landed_at else now) - self.started,
            Phase.TOTAL: now - created,
        }
        if self.claim_s is not None:
            phases[Phase.CLAIM] = self.claim_s
        if self.handshake_waits is not None:
            phases[Phase.HANDSHAKE_REPLY] = self.handshake_waits["reply"]
            phases[Phase.HANDSHAKE_PICKUP] = self.handshake_waits["pickup"]
            phases[Phase.HANDSHAKE_CONNECT] = self.handshake_waits["connect"]
        return phases

    def fail(self, reason: FailReason, message: str, cause: BaseException | None = None) -> None:
        """Failed with nothing in flight: reported at the next results."""
        self.phase = RecvPhase.FAILED
        self.error = RecvFailure(reason, message, cause)
        self.read = self.fence = self.settle = None

    def begin_settling(self, failure: RecvFailure, now: float, timeout_s: float, handles: list[Any]) -> None:
        """Failed with a transfer that may still move bytes: reported once it ended."""
        self.phase = RecvPhase.SETTLING
        self.error = failure
        self.read = self.fence = None
        self.settle = Settle(failure, now, now + timeout_s, handles)
