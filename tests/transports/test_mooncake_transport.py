"""MooncakeTransport against the real Mooncake engine (TCP): a peer process on 127.0.0.1, bytes verified, faults typed."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kv_connectors.errors import ConfigError, PeerDisconnectedError, TransferTimeoutError, TransportError
from kv_connectors.mooncake import metadata as mooncake_metadata
from kv_connectors.mooncake.transport import MooncakeTransport
from kv_connectors.plan import TransferPlan, plan_transfer
from kv_connectors.transports.base import XferState
from kvc_testing import kvbuffers
from kvc_testing.peers import Local, Peer, PeerSpec, open_local, peer_starter
from tests.transports.helpers import random_pairs, read_until_error, wait_done

pytestmark = pytest.mark.timeout(120)

WAIT_S = 15.0
FAULT_DEADLINE_S = 6.0  # a dead peer: engine reconnect attempts (~1-2 s) + our liveness probe


@pytest.fixture
def start_peer() -> Iterator[Callable[..., Peer]]:
    with peer_starter("mooncake", WAIT_S) as start:
        yield start


def _local(name: str, seed: int, profile: str = "small") -> Local:
    return open_local(PeerSpec("mooncake", f"{name}-{os.getpid()}", seed, profile))


@pytest.fixture
def local() -> Iterator[Local]:
    loc = _local("d", seed=100)
    yield loc
    loc.close()


def test_read_random_blocks(local: Local, start_peer: Any) -> None:
    p = start_peer(seed=1)
    t = local.transport
    t.connect(p.name, p.metadata)
    src_ids, dst_ids = random_pairs(np.random.default_rng(0), kvbuffers.SMALL_BLOCKS)
    plan = plan_transfer(p.layout, src_ids, local.layout, dst_ids)
    regions = len(local.layout.regions)
    assert regions == 5
    assert regions < plan.num_runs < regions * len(src_ids)  # partial coalescing
    expected = [a.copy() for a in local.storage]
    kvbuffers.block_copy(expected, kvbuffers.make_kv(seed=1), src_ids, dst_ids)
    assert not all(np.array_equal(e, a) for e, a in zip(expected, local.storage))

    handle = t.post_read(p.name, plan, b"read-1")
    assert (handle.num_runs, handle.nbytes, handle.num_batches) == (plan.num_runs, plan.total_bytes, 1)
    p.wait_notif(t.name, b"read-1")
    # The notification follows the data: our bytes are final before we even poll.
    for got, want in zip(local.storage, expected):  # copied blocks right, all other bytes untouched
        np.testing.assert_array_equal(got, want)
    wait_done(t, handle, WAIT_S)
    assert p.call("dump")[0].tobytes() == kvbuffers.make_kv(seed=1)[0].tobytes()  # source unchanged


def test_write_random_blocks_notif_after_data(local: Local, start_peer: Any) -> None:
    p = start_peer(seed=2)
    t = local.transport
    t.connect(p.name, p.metadata)
    src_ids, dst_ids = random_pairs(np.random.default_rng(1), kvbuffers.SMALL_BLOCKS)
    plan = plan_transfer(local.layout, src_ids, p.layout, dst_ids)
    assert len(local.layout.regions) < plan.num_runs < len(local.layout.regions) * len(src_ids)
    expected = kvbuffers.make_kv(seed=2)
    kvbuffers.block_copy(expected, local.storage, src_ids, dst_ids)

    binary = bytes(range(256))  # any bytes survive (Mooncake notifies carry text)
    wait_done(t, t.post_write(p.name, plan, binary), WAIT_S)
    digest_at_notif = p.wait_notif(t.name, binary)
    assert digest_at_notif == kvbuffers.storage_digest(expected)  # the data had landed when the notif arrived
    for got, want in zip(p.call("dump"), expected):
        np.testing.assert_array_equal(got, want)


def test_plan_larger_than_max_batch(start_peer: Any) -> None:
    """~2500 runs: three engine batches (one batch of that size overflows the engine's TCP queue)."""
    p = start_peer(seed=5, profile="big")
    loc = _local("big", seed=6, profile="big")
    t = loc.transport
    try:
        t.connect(p.name, p.metadata)
        rng = np.random.default_rng(7)
        src_ids = rng.permutation(kvbuffers.BIG_BLOCKS)[:2500]
        dst_ids = rng.permutation(kvbuffers.BIG_BLOCKS)[:2500]
        expected = [a.copy() for a in loc.storage]
        kvbuffers.block_copy(expected, kvbuffers.make_kv(seed=5, profile="big"), src_ids, dst_ids)
        plan = plan_transfer(p.layout, src_ids, loc.layout, dst_ids)
        assert plan.num_runs > 2400
        handle = t.post_read(p.name, plan, b"big-read")
        assert handle.num_batches == 3
        slowest = 0.0
        deadline = time.monotonic() + WAIT_S
        while True:
            t0 = time.perf_counter()
            state = t.poll(handle)
            slowest = max(slowest, time.perf_counter() - t0)
            if state is XferState.DONE:
                break
            assert time.monotonic() < deadline, "big read not done in time"
            time.sleep(0.0005)
        t.release(handle)
        assert slowest < 0.5, f"poll() blocked for {slowest:.3f} s"  # generous: the host is shared
        np.testing.assert_array_equal(loc.storage[0], expected[0])
        p.wait_notif(t.name, b"big-read")

        back = plan_transfer(loc.layout, dst_ids, p.layout, src_ids)  # and write them back, 3 batches too
        want = kvbuffers.make_kv(seed=5, profile="big")
        wait_done(t, t.post_write(p.name, back, b"big-write"), WAIT_S)
        assert p.wait_notif(t.name, b"big-write") == kvbuffers.storage_digest(want)

        everything = plan_transfer(p.layout, np.arange(kvbuffers.BIG_BLOCKS), loc.layout, np.arange(kvbuffers.BIG_BLOCKS)[::-1])
        dropped = t.post_read(p.name, everything, b"released")  # 9 batches; stops after the current one
        t.release(dropped)
        t.release(dropped)  # twice is fine too
        with pytest.raises(TransportError, match="released"):
            t.poll(dropped)
        wait_done(t, t.post_read(p.name, plan_transfer(p.layout, [0], loc.layout, [0]), b"after"), WAIT_S)
        p.wait_notif(t.name, b"after")
        assert all(m != b"released" for _, m, _ in p.call("notifs"))
    finally:
        t.close()


def test_empty_plan_delivers_notif(local: Local, start_peer: Any) -> None:
    p = start_peer()
    t = local.transport
    t.connect(p.name, p.metadata)
    before = [a.copy() for a in local.storage]
    wait_done(t, t.post_read(p.name, plan_transfer(p.layout, [], local.layout, []), b"empty-read"), WAIT_S)
    wait_done(t, t.post_write(p.name, plan_transfer(local.layout, [], p.layout, []), b"empty-write"), WAIT_S)
    silent = t.post_read(p.name, plan_transfer(p.layout, [], local.layout, []), b"")
    assert t.poll(silent) is XferState.DONE  # nothing to move, nothing to say
    t.release(silent)
    p.wait_notif(t.name, b"empty-read")
    p.wait_notif(t.name, b"empty-write")
    assert all(np.array_equal(a, b) for a, b in zip(before, local.storage))
    assert p.call("notifs") == []


def test_notifs_and_unknown_peer(local: Local, start_peer: Any) -> None:
    p = start_peer()
    t = local.transport
    plan = plan_transfer(p.layout, [0], local.layout, [0])
    with pytest.raises(TransportError, match="not connected"):
        t.post_read(p.name, plan, b"x")
    with pytest.raises(TransportError, match="not connected"):
        t.send_notif(p.name, b"x")
    t.connect(p.name, p.metadata)
    t.connect(p.name, p.metadata)  # same incarnation again: a no-op
    for i in range(3):
        t.send_notif(p.name, b"hello %d" % i)
    for i in range(3):
        p.wait_notif(t.name, b"hello %d" % i)
    assert t.get_notifs() == []
    t.disconnect(p.name)
    t.disconnect("nobody")
    with pytest.raises(TransportError):
        t.post_read(p.name, plan, b"x")
    with pytest.raises(TransportError, match="metadata"):
        t.connect("q", b"not mooncake metadata")


def test_bad_addresses(local: Local, start_peer: Any) -> None:
    p = start_peer()
    t = local.transport
    t.connect(p.name, p.metadata)
    plan = plan_transfer(p.layout, [0, 1], local.layout, [2, 3])
    outside = TransferPlan(plan.src, plan.dst + (1 << 40), plan.length, 2)
    with pytest.raises(TransportError, match="registered memory"):  # ours: checked before posting
        t.post_read(p.name, outside, b"")
    remote_bad = TransferPlan(plan.src - (1 << 30), plan.dst, plan.length, 2)
    with pytest.raises(TransportError, match="the peer registered"):  # theirs: against its advertised ranges
        t.post_read(p.name, remote_bad, b"never")
    # A peer that advertises more than it registered: its engine refuses the run (alive, not disconnected).
    info = mooncake_metadata.decode_metadata(p.metadata)
    boastful = msgspec.structs.replace(info, ranges=[(0, 1 << 62)])
    t.connect(p.name, mooncake_metadata.MD_MAGIC + msgspec.msgpack.encode(boastful))
    handle = t.post_read(p.name, remote_bad, b"never")
    with pytest.raises(TransportError, match="rc -1") as err:
        wait_done(t, handle, WAIT_S)
    assert not isinstance(err.value, PeerDisconnectedError)
    t.connect(p.name, p.metadata)
    wait_done(t, t.post_read(p.name, plan, b"fine"), WAIT_S)  # the connection still works
    p.wait_notif(t.name, b"fine")
    assert all(m != b"never" for _, m, _ in p.call("notifs"))


def test_peer_killed_before_read(local: Local, start_peer: Any) -> None:
    p = start_peer()
    t = local.transport
    t.connect(p.name, p.metadata)
    plan = plan_transfer(p.layout, [1, 2, 7], local.layout, [4, 5, 9])
    wait_done(t, t.post_read(p.name, plan, b""), WAIT_S)  # connection is up
    p.kill()
    started = time.monotonic()
    err, done = read_until_error(t, p.name, plan, started + FAULT_DEADLINE_S)
    assert isinstance(err, PeerDisconnectedError), repr(err)
    assert done == 0
    assert time.monotonic() - started < FAULT_DEADLINE_S
    t.send_notif(p.name, b"to the dead")  # queued; its failure is only logged
    t.disconnect(p.name)


def test_peer_killed_while_reading(start_peer: Any) -> None:
    p = start_peer(seed=8, profile="big")
    loc = _local("kill", seed=9, profile="big")
    t = loc.transport
    try:
        t.connect(p.name, p.metadata)
        ids = np.random.default_rng(3).permutation(kvbuffers.BIG_BLOCKS)
        plan = plan_transfer(p.layout, ids, loc.layout, np.random.default_rng(4).permutation(kvbuffers.BIG_BLOCKS))
        assert plan.num_runs > kvbuffers.BIG_BLOCKS // 2
        killer = threading.Timer(0.3, lambda: os.kill(p.proc.pid, signal.SIGKILL))
        killer.start()
        try:
            err, done = read_until_error(t, p.name, plan, time.monotonic() + 0.3 + FAULT_DEADLINE_S)
        finally:
            killer.cancel()
        assert isinstance(err, PeerDisconnectedError), repr(err)
        print(f"killed after {done} full reads: {err!r}")
    finally:
        t.close()
    p.proc.join(WAIT_S)


def test_frozen_peer_times_out_and_close_does_not_hang(start_peer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped (not dead) peer: the engine gives up after MC_TRANSFER_TIMEOUT (5 s, its minimum)."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # read by each new engine
    p = start_peer()
    loc = _local("frozen", seed=3)
    t = loc.transport
    try:
        t.connect(p.name, p.metadata)
        plan = plan_transfer(p.layout, [1, 2, 7], loc.layout, [4, 5, 9])
        wait_done(t, t.post_read(p.name, plan, b""), WAIT_S)  # connection is up
        os.kill(p.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        handle = t.post_read(p.name, plan, b"frozen")
        with pytest.raises(TransferTimeoutError, match="did not answer in time"):
            wait_done(t, handle, 20.0)
        assert 4.0 < time.monotonic() - started < 20.0
        stuck = t.post_read(p.name, plan, b"")
        time.sleep(0.2)  # the peer thread is now inside the engine's wait (for 5 s)
        t0 = time.monotonic()
        assert t.poll(stuck) is XferState.IN_PROGRESS
        assert time.monotonic() - t0 < 1.0  # poll() does not wait for the engine
    finally:
        started = time.monotonic()
        t.close()  # does not wait for the engine's timeout
        assert time.monotonic() - started < 4.0
        os.kill(p.proc.pid, signal.SIGKILL)
    with pytest.raises(TransportError):
        t.poll(stuck)


def test_reconnect_restarted_peer(local: Local, start_peer: Any) -> None:
    t = local.transport
    first = start_peer(name="p", seed=11)
    t.connect("p", first.metadata)
    plan = plan_transfer(first.layout, [0, 1, 2], local.layout, [5, 6, 7])
    wait_done(t, t.post_read("p", plan, b"one"), WAIT_S)
    first.wait_notif(t.name, b"one")
    first.kill()

    second = start_peer(name="p", seed=12)  # same name, new memory and a new engine address
    assert second.metadata != first.metadata
    t.connect("p", second.metadata)
    plan = plan_transfer(second.layout, [8, 9, 30], local.layout, [5, 6, 7])
    expected = [a.copy() for a in local.storage]
    kvbuffers.block_copy(expected, kvbuffers.make_kv(seed=12), [8, 9, 30], [5, 6, 7])
    wait_done(t, t.post_read("p", plan, b"two"), WAIT_S)
    for got, want in zip(local.storage, expected):
        np.testing.assert_array_equal(got, want)
    second.wait_notif(t.name, b"two")


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        MooncakeTransport("x", max_batch=0)
    with pytest.raises(ConfigError):
        MooncakeTransport("")
    name = f"closed-{os.getpid()}"
    t = MooncakeTransport(name)
    with pytest.raises(ConfigError, match="already open"):
        MooncakeTransport(name)
    assert t.session_id.startswith("127.0.0.1:")
    t.close()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.get_notifs()
    MooncakeTransport(name).close()  # the name is free again
