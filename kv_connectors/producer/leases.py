"""P's leases: blocks held for a D that will read (or be written from) them, the fence's claims on them, their end."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from kv_connectors.counters import DURATIONS_CAP
from kv_connectors.fence import LeaseWords, lease_word
from kv_connectors.wire import ClaimResult

# How long a D notification may precede the P worker learning of the request (seconds).
_EARLY_NOTICE_TTL_S = 600.0
# Keys of ended leases remembered so that a late claim is refused at once (not left to its deadline).
_GONE_CAP = 100_000


@dataclasses.dataclass
class _Early:
    """Notices for a key whose lease is not known yet: when the first came, the digest it stated, and
    (a consumer whose `readers` ranks each read part of the blocks) which of them are done."""

    at: float
    digest: str
    engine: str | None = None
    readers: int = 1
    done: set[str] = dataclasses.field(default_factory=set)

    @property
    def complete(self) -> bool:
        """Every reader of the consumer is done (or the notice did not name one: one reader)."""
        return self.engine is None or len(self.done) >= self.readers


@dataclasses.dataclass
class _Lease:
    request_id: str  # vLLM's id of P's request: what is reported when the blocks may be freed
    block_ids: tuple[int, ...]
    deadline: float
    claims: dict[str, float] = dataclasses.field(default_factory=dict)  # consumer (reader) -> claim deadline
    created: float = 0.0
    done: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # consumer engine -> its readers done
    prompt_digest: str = ""  # params.prompt_digest of the prefill's prompt ("": unknown)
    group_sizes: tuple[int, ...] = ()  # a hybrid's blocks per KV cache group (block_ids side by side)
    # A consumer is done with it but writes from its blocks are still in flight: it ends (and its
    # request is reported finished) once they settle.
    release_pending: bool = False


@dataclasses.dataclass(frozen=True)
class Claim:
    result: ClaimResult
    reason: str = ""


class SendLeases:
    """P side: blocks held for a D that will read them; freed on its notice or when the lease expires.

    Leases are keyed by what D names them by: P's request id, or the transfer id the request
    came with. A notice may arrive before the lease is added (D can be faster than P's next
    step, and in the transfer-id flow D may be done before P computed anything): it is
    remembered and completes the lease as soon as it is added.

    The fence: a consumer that reads P's blocks claims the lease first (`claim`, from the side-channel
    thread, hence the lock). A claimed lease is held for the consumer until its claim deadline or its
    notice; a lease that already ended is refused, and is remembered as gone (bounded), so that a
    late reader fails at once instead of reading blocks that other prompts reuse.

    With `words` (kv_connectors.fence), a live lease's blocks carry its lease word, cleared as the
    lease ends (before its request is reported finished): a consumer that reads the words after its
    data read needs no claim.

    `writing(key)` (the sender's): whether a push write from the blocks held under key is in flight.
    While one is, the lease neither ends on a notice (any consumer's: a release, another reader,
    an early notice) nor expires: its blocks are freed only once every write from them settled
    (the sender notices the lease again as each one ends).
    """

    def __init__(
        self,
        gone_cap: int = _GONE_CAP,
        words: LeaseWords | None = None,
        epoch: str = "",
        writing: Callable[[str], bool] = lambda key: False,
    ) -> None:
        self._lock = threading.Lock()
        self._words = words
        self._epoch = epoch
        self._writing = writing
        self._leases: dict[str, _Lease] = {}
        # Leases another lease under the same key replaced (a router's second prefill under one
        # transfer id), with their key: freed once no write or claim can still use their blocks.
        self._replaced: list[tuple[str, _Lease]] = []
        self._early: dict[str, _Early] = {}
        self._gone: dict[str, str] = {}  # key -> why it ended (insertion order: oldest first, capped)
        self._gone_cap = gone_cap
        self._finished: set[str] = set()  # request ids
        self._finished_keys: set[str] = set()
        self.completed = 0
        self.expired = 0
        self.claims_granted = 0
        self.claims_refused = 0
        self.hold_seconds: list[float] = []  # each ended lease's hold, until taken for metrics (bounded)

    def add(
        self,
        key: str,
        request_id: str,
        block_ids: tuple[int, ...],
        now: float,
        lease_s: float,
        prompt_digest: str = "",
        group_sizes: tuple[int, ...] = (),
    ) -> None:
        with self._lock:
            self._gone.pop(key, None)
            early = self._early.pop(key, None)
            released = early is not None and not other_prompt(early.digest, prompt_digest)
            if released and early is not None and not early.complete:  # other ranks of that consumer still read
                released = False
            else:
                early = early if released else None
            if released and not self._writing(key):
                self._end(key, "released by the consumer before the lease began")
                self._finished.add(request_id)
                self._finished_keys.add(key)
                self.completed += 1
                return
            old = self._leases.get(key)
            if old is not None:  # the same key again: the old lease's blocks lose its word first
                self._unmark(key, old)
                self._replaced.append((key, old))
            lease = self._leases[key] = _Lease(
                request_id, tuple(block_ids), now + lease_s, created=now, prompt_digest=prompt_digest, group_sizes=group_sizes
            )
            lease.release_pending = released  # a layer-wise write from its blocks is still in flight
            if early is not None and early.engine is not None and not early.complete:
                lease.done[early.engine] = set(early.done)  # the ranks done before the lease existed
            if self._words is not None and not released:
                self._words.mark(lease_word(self._epoch, key), lease.block_ids)

    def block_ids(self, key: str) -> tuple[int, ...] | None:
        with self._lock:
            lease = self._leases.get(key)
            return None if lease is None else lease.block_ids

    def group_sizes(self, key: str) -> tuple[int, ...]:
        """A hybrid's lease: its blocks per KV cache group (() for one group, or no lease)."""
        with self._lock:
            lease = self._leases.get(key)
            return () if lease is None else lease.group_sizes

    def prompt_digest(self, key: str) -> str:
        """The prompt digest of the live lease under key ("" when unknown or no such lease)."""
        with self._lock:
            lease = self._leases.get(key)
            return "" if lease is None else lease.prompt_digest

    def claim(self, key: str, consumer: str, block_ids: tuple[int, ...], now: float, hold_s: float) -> Claim:
        """A consumer reads block_ids of the lease under key: hold them for it until now + hold_s."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is None:
                gone = self._gone.get(key)
                early = self._early.get(key)
                if gone is None and early is not None and early.complete:
                    gone = "released by the consumer"
                if gone is None:
                    return Claim(ClaimResult.PENDING, "not known here (yet)")
                self.claims_refused += 1
                return Claim(ClaimResult.GONE, gone)
            if not set(block_ids) <= set(lease.block_ids):
                self.claims_refused += 1
                return Claim(ClaimResult.MISMATCH, f"{len(block_ids)} claimed blocks are not all held under this key")
            until = now + hold_s
            lease.claims[consumer] = max(lease.claims.get(consumer, 0.0), until)
            lease.deadline = max(lease.deadline, until)
            self.claims_granted += 1
            return Claim(ClaimResult.GRANTED)

    def gone(self, key: str) -> str | None:
        """Why the lease under key ended, if it did (and is still remembered)."""
        with self._lock:
            return self._gone.get(key)

    def renew(self, key: str, now: float, lease_s: float) -> bool:
        """A consumer still wants the blocks (its request waits in its queue): extend the lease."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is None:
                return False
            lease.deadline = max(lease.deadline, now + lease_s)
            return True

    def notice(
        self,
        key: str,
        now: float,
        consumer: str | None = None,
        engine: str | None = None,
        readers: int = 1,
        prompt_digest: str = "",
    ) -> bool:
        """D is done with the blocks held under key (consumer: the reader, when known: D's engine id,
        or one of its tensor-parallel ranks; engine: that D's engine id, whose `readers` ranks each
        read part of the blocks: the blocks stay until every one of them is done).

        Another consumer's live claim keeps the blocks until that claim ends. A notice stating the
        digest of another prompt than the lease's is ignored (False): a request for another prompt
        under the same key frees nothing."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is not None and other_prompt(prompt_digest, lease.prompt_digest):
                return False
            if lease is not None:
                if consumer is not None:
                    lease.claims.pop(consumer, None)
                    if engine is not None and readers > 1 and not lease.release_pending:
                        done = lease.done.setdefault(engine, set())
                        done.add(consumer)
                        if len(done) < readers:
                            return True
                if any(until > now for until in lease.claims.values()):
                    return True
                if self._writing(key):  # a write still reads the blocks: ended when it settles
                    lease.release_pending = True
                    return True
                del self._leases[key]
                self._held(lease, now)
                self._end(key, "released after the consumer read it", lease)
                self._finished.add(lease.request_id)
                self._finished_keys.add(key)
                self.completed += 1
            elif key not in self._finished_keys and key not in self._gone:
                early = self._early.get(key)
                if early is None or other_prompt(prompt_digest, early.digest):
                    early = _Early(now, prompt_digest)
                    _put_bounded(self._early, key, early, self._gone_cap)  # keys come from peers
                if consumer is not None and engine is not None and readers > 1:
                    early.engine, early.readers = engine, readers
                    early.done.add(consumer)
            return True

    def _held(self, lease: _Lease, now: float) -> None:
        if len(self.hold_seconds) < DURATIONS_CAP:
            self.hold_seconds.append(max(0.0, now - lease.created))

    def take_hold_seconds(self) -> list[float]:
        with self._lock:
            out, self.hold_seconds = self.hold_seconds, []
            return out

    def _end(self, key: str, why: str, lease: _Lease | None = None) -> None:
        if lease is not None:
            self._unmark(key, lease)
        _put_bounded(self._gone, key, why, self._gone_cap)

    def _unmark(self, key: str, lease: _Lease) -> None:
        """Clear the lease's words: from here on a consumer's words read proves nothing."""
        if self._words is not None:
            self._words.clear(lease_word(self._epoch, key), lease.block_ids)

    def take_finished(self, now: float) -> tuple[set[str], set[str]]:
        """(completed, expired) request ids since the last call; both are to be freed."""
        with self._lock:
            expired_keys = [k for k, lease in self._leases.items() if lease.deadline <= now and not self._writing(k)]
            expired = set()
            for key in expired_keys:
                lease = self._leases.pop(key)
                self._held(lease, now)
                expired.add(lease.request_id)
                self._end(key, "its lease expired before the consumer claimed it", lease)
            self.expired += len(expired)
            for key in [key for key, early in self._early.items() if now - early.at > _EARLY_NOTICE_TTL_S]:
                del self._early[key]
            done, self._finished = self._finished, set()
            if self._replaced:
                free = [(k, old) for k, old in self._replaced if _claims_end(old) <= now and not self._writing(k)]
                self._replaced = [r for r in self._replaced if r not in free]
                done |= {old.request_id for _key, old in free}
            self._finished_keys.clear()
            return done, expired

    @property
    def active(self) -> bool:
        """Leases held, or ended ones not reported yet."""
        with self._lock:
            return bool(self._leases or self._finished or self._replaced)

    @property
    def held_requests(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def held_blocks(self) -> int:
        with self._lock:
            held = [*self._leases.values(), *(old for _key, old in self._replaced)]
            return sum(len(lease.block_ids) for lease in held)


def _claims_end(lease: _Lease) -> float:
    """When the last of the lease's claims lapses (0: none)."""
    return max(lease.claims.values(), default=0.0)


def other_prompt(stated: str, held: str) -> bool:
    """A consumer stated the digest of another prompt than the lease's (either unstated: not checked)."""
    return bool(stated and held and stated != held)


def _put_bounded(d: dict[str, Any], key: str, value: Any, cap: int) -> None:
    """d[key] = value, dropping the oldest entries beyond cap (dicts keep insertion order)."""
    d[key] = value
    while len(d) > cap:
        del d[next(iter(d))]
