"""Test-side helpers shared by the transport tests and the contract suite: waits, block choices and plans.

Peers and transports come from kvc_testing.peers, KV caches from kvc_testing.kvbuffers (one harness
for tests and benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kv_connectors.errors import TransportError
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import XferState
from kvc_testing.kvbuffers import STAGED_BLOCKS


# Waits ---------------------------------------------------------------------------------------
def wait_all(
    t: Any, handles: Sequence[Any], timeout: float, on_poll: Callable[[], None] | None = None, sleep_s: float = 0.0002
) -> None:
    """Poll until every handle is DONE (errors propagate), then release them (also on failure)."""
    deadline = time.monotonic() + timeout
    pending = list(handles)
    try:
        while pending:
            pending = [h for h in pending if t.poll(h) is not XferState.DONE]
            if on_poll is not None:
                on_poll()
            if pending and time.monotonic() > deadline:
                raise AssertionError(
                    f"transfers not done within {timeout} s: {[(h.op, getattr(h, 'chunks_done', '?'), h.nbytes) for h in pending]}"
                )
            time.sleep(sleep_s if pending else 0)
    finally:
        for h in handles:
            t.release(h)


def wait_done(t: Any, handle: Any, timeout: float) -> None:
    """One transfer to DONE, then released (also on failure)."""
    wait_all(t, [handle], timeout, sleep_s=0.001)


def read_until_error(t: Any, peer_name: str, plan: Any, deadline: float) -> tuple[TransportError, int]:
    """Post reads back to back until one fails; never waits past deadline (then fails the test)."""
    done = 0
    while True:
        try:
            handle = t.post_read(peer_name, plan, b"")
        except TransportError as e:
            return e, done
        try:
            while t.poll(handle) is XferState.IN_PROGRESS:
                if time.monotonic() > deadline:
                    raise AssertionError("transfer to a killed peer did not fail before the deadline")
                time.sleep(0.0005)
            done += 1
        except TransportError as e:
            return e, done
        finally:
            t.release(handle)  # never raises, also on a failed or unfinished transfer
        if time.monotonic() > deadline:
            raise AssertionError("reads from a killed peer kept succeeding past the deadline")


def wait_slots_free(t: Any, timeout: float) -> None:
    """A staging transport holds no slot and queues nothing (progressed meanwhile)."""
    deadline = time.monotonic() + timeout
    while t.pool_stats()["slots_in_use"] or t.pool_stats()["queued"]:
        if time.monotonic() > deadline:
            raise AssertionError(f"slots still held after {timeout} s: {t.pool_stats()}")
        t.progress()
        time.sleep(0.005)


# Block choices and plans ---------------------------------------------------------------------
def random_pairs(rng: np.random.Generator, nb: int) -> tuple[list[int], list[int]]:
    """Shuffled pairs with two runs consecutive on both sides (coalescable) and random singles."""
    src = [3, 4, 5, 20, 21]
    dst = [10, 11, 12, 1, 2]
    rest_src = [b for b in rng.permutation(nb).tolist() if b not in src][:7]
    rest_dst = [b for b in rng.permutation(nb).tolist() if b not in dst][:7]
    pairs = list(zip(src + rest_src, dst + rest_dst))
    order = rng.permutation(len(pairs))
    return [pairs[i][0] for i in order], [pairs[i][1] for i in order]


def pick_blocks(
    seed: int, n: int = 256, src_pool: Sequence[int] = range(STAGED_BLOCKS), dst_pool: Sequence[int] = range(STAGED_BLOCKS)
) -> tuple[list[int], list[int]]:
    """n shuffled pairs; where both pools allow, 40 blocks consecutive on both sides (100..139 ->
    200..239: a run longer than a 64 KiB chunk in the packed regions of the "staged" profile)."""
    rng = np.random.default_rng(seed)
    src, dst = [], []
    if set(range(100, 140)) <= set(src_pool) and set(range(200, 240)) <= set(dst_pool):
        src, dst = list(range(100, 140)), list(range(200, 240))
    src += [b for b in rng.permutation(list(src_pool)).tolist() if b not in src][: n - len(src)]
    dst += [b for b in rng.permutation(list(dst_pool)).tolist() if b not in dst][: n - len(dst)]
    order = rng.permutation(n)
    return [src[i] for i in order], [dst[i] for i in order]


def plan_of_runs(runs: Sequence[tuple[int, int, int]]) -> TransferPlan:
    """A plan of (src, dst, length) runs as given."""
    a = np.array(runs, dtype=np.int64).reshape(-1, 3)
    return TransferPlan(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), len(runs))


def bytes_covered(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Every byte address the runs cover, in order."""
    if length.size == 0:
        return np.zeros(0, np.int64)
    return np.repeat(addr - (np.cumsum(length) - length), length) + np.arange(int(length.sum()))
