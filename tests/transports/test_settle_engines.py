"""settled() against the real engines, two processes over TCP (UCX_TLS=tcp for NIXL; Mooncake tcp),
P stopped with SIGSTOP mid-transfer: a read given up on (aborted) is not settled while P is stopped,
its bytes land once P resumes (release stops nothing: the contract says so), and once settled() says
so nothing more lands in the buffer standing for blocks vLLM would reuse. A killed P settles too.
The same holds for a plan that staging "fragmented" moves directly (its handle wraps the engine's)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kv_connectors.plan import plan_transfer
from kv_connectors.transports.base import XferState
from kv_connectors.transports.staging.direct import FragmentRule
from kvc_testing import kvbuffers
from kvc_testing import peers as peer
from kvc_testing.peers import Local, PeerSpec, open_local, start_peers, stop_peers
from kvc_testing.procs import stop_process

pytestmark = pytest.mark.timeout(180)

WAIT_S = 30.0
DIRECT = FragmentRule(1 << 62, 1)  # staging "fragmented" whose rule stages nothing: every plan direct


@pytest.fixture(params=["nixl", "mooncake", "nixl-fragmented", "mooncake-fragmented"])
def kind(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param.startswith("nixl"):
        monkeypatch.setenv("UCX_TLS", "tcp")  # over cma a stopped process's memory still answers: TCP stalls
    return str(request.param)


def _spec(kind: str, name: str, seed: int) -> PeerSpec:
    engine, _, staging = kind.partition("-")
    if not staging:
        return PeerSpec(engine, name, seed, "big")
    return PeerSpec(engine, name, seed, "big", pool=4 << 20, chunk=1 << 20, fragments=DIRECT)


@pytest.fixture
def setup(kind: str) -> Iterator[tuple[Any, Local]]:
    with peer.loopback_env():
        p = start_peers([_spec(kind, "p", 1)], WAIT_S)[0]
        try:
            local = open_local(_spec(kind, f"d-settle-{os.getpid()}", 100))
            try:
                local.transport.connect(p.name, p.metadata)
                yield p, local
            finally:
                local.close()
                if p.alive:
                    os.kill(p.proc.pid, signal.SIGCONT)
        finally:
            stop_peers([p])


def _wait_done(t: Any, handle: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while t.poll(handle) is not XferState.DONE:
        assert time.monotonic() < deadline, "transfer not done"
        time.sleep(0.001)


def _wait_settled(t: Any, handle: Any, seconds: float) -> float:
    started = time.monotonic()
    while not t.settled(handle):
        assert time.monotonic() - started < seconds, "never settled"
        time.sleep(0.005)
    return time.monotonic() - started


def _landed(local: Local) -> int:
    return sum(int(np.count_nonzero(a)) for a in local.storage)


def _stopped_read(p: Any, local: Local) -> Any:
    """Post a 32 MiB read of P's blocks with P stopped, and give up on it."""
    t = local.transport
    one = plan_transfer(p.layout, [0], local.layout, [0])
    _wait_done(t, t.post_read(p.name, one, b""))  # the connection is up
    for a in local.storage:
        a[:] = 0
    n = kvbuffers.BIG_BLOCKS
    full = plan_transfer(p.layout, list(range(n)), local.layout, list(range(n)))
    stop_process(p.proc.pid)  # stopped before the read is posted, however busy the host
    handle = t.post_read(p.name, full, b"")
    time.sleep(0.5)
    t.abort(handle)
    return handle


def test_a_read_given_up_while_its_peer_is_stopped_settles_only_once_its_bytes_landed(setup: Any) -> None:
    p, local = setup
    t = local.transport
    handle = _stopped_read(p, local)
    for _ in range(20):
        assert not t.settled(handle), "settled with its peer stopped and its bytes not landed"
        time.sleep(0.05)
    assert _landed(local) == 0
    os.kill(p.proc.pid, signal.SIGCONT)
    _wait_settled(t, handle, WAIT_S)
    seen = [a.copy() for a in local.storage]
    time.sleep(1.5)
    assert all(np.array_equal(a, b) for a, b in zip(seen, local.storage)), "bytes landed after settled()"
    t.release(handle)
    assert _landed(local) > 0, "the released read moved nothing: the engine stopped it after all (update the docs)"
    if hasattr(t, "pool_stats"):  # fragmented: the engine's own transfer, not one through the pool
        assert (t.pool_stats()["direct_posts"], t.pool_stats()["staged_posts"]) == (2, 0)


def test_a_read_whose_peer_is_killed_while_stopped_settles(setup: Any) -> None:
    p, local = setup
    t = local.transport
    handle = _stopped_read(p, local)
    assert not t.settled(handle)
    os.kill(p.proc.pid, signal.SIGKILL)
    waited = _wait_settled(t, handle, 20.0)
    assert waited < 20.0
    t.release(handle)
