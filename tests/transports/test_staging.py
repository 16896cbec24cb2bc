"""StagedTransport around the real NIXL and Mooncake engines: peers in other processes, bytes verified, faults typed."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kv_connectors.errors import ConfigError, PeerDisconnectedError, TransportError, TransportUnavailableError
from kv_connectors.plan import TransferPlan, plan_transfer
from kv_connectors.transports import staging
from kv_connectors.transports.base import MemoryKind, XferState
from kv_connectors.transports.staging import StagedTransport, StagedXfer, chunk_plan
from kvc_testing import kvbuffers
from kvc_testing.kvbuffers import block_copy, layout_of, storage_digest
from kvc_testing.peers import Local, Peer, PeerSpec, open_local, open_transport, start_peers, stop_peers
from tests.transports import helpers
from tests.transports.helpers import bytes_covered, pick_blocks, plan_of_runs

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("loopback_env")]

WAIT_S = 20.0
FAULT_DEADLINE_S = 8.0  # probe interval (0.5 s) + the engine's dead-peer detection (Mooncake: up to ~2 s)
KiB, MiB = 1024, 1024 * 1024
POOL, CHUNK = 256 * KiB, 64 * KiB  # 4 slots; a 4 MiB request is 64+ chunks
NB = kvbuffers.STAGED_BLOCKS  # blocks; a block is 16 KiB over 4 regions (packed, K/V-split packed, padded)
_names = itertools.count()


def kv(seed: int) -> list[np.ndarray]:
    return kvbuffers.make_kv(seed, "staged")


def spec(kind: str, name: str, seed: int = 100, pool: int = POOL, chunk: int = CHUNK) -> PeerSpec:
    """A staging transport (probed every 0.5 s) over a "staged" KV cache."""
    return PeerSpec(kind, name, seed, "staged", pool, chunk)


def local_spec(kind: str, pool: int = POOL, chunk: int = CHUNK) -> PeerSpec:
    return spec(kind, f"d{next(_names)}-{os.getpid()}", pool=pool, chunk=chunk)


def wait_all(
    t: StagedTransport, handles: Sequence[StagedXfer], timeout: float = WAIT_S, on_poll: Callable[[], None] | None = None
) -> None:
    helpers.wait_all(t, handles, timeout, on_poll)


def wait_slots_free(t: StagedTransport, timeout: float = FAULT_DEADLINE_S) -> None:
    helpers.wait_slots_free(t, timeout)


def check_pool(loc: Local) -> None:
    """The pool is the configured size, allocated once, and peak use stayed within it."""
    stats = loc.transport.pool_stats()
    pool = loc.transport.pool
    assert pool.numel() * pool.element_size() == stats["pool_bytes"] == POOL
    assert stats["slots"] == POOL // CHUNK
    assert 2 <= stats["peak_slots_in_use"] <= stats["slots"]  # several chunks were in flight, never more
    assert stats["slots_in_use"] == 0


# In-process (the memory transport): a peer's hostile messages, a death only a probe can see ------------
class _RecordingCopier:
    """Records the copies asked for and copies nothing (a hostile run must never reach memmove)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[int, int, int]] = []

    def copy(self, pairs: Sequence[tuple[int, int, int]]) -> None:
        self.pairs += pairs

    def synchronize(self) -> None:
        pass


def _memory_pair(copier: Any = None, probe_interval_s: float = 1.0) -> tuple[Any, list[StagedTransport], list[Any]]:
    """Two staging transports "a" and "b" over one MemoryFabric, connected, each with a 4-region KV cache."""
    from kv_connectors.transports.memory import MemoryFabric, MemoryTransport, host_layout

    fabric = MemoryFabric()
    ts, layouts, bufs = [], [], []
    for i, name in enumerate(("a", "b")):
        buf = np.random.default_rng(i).integers(0, 256, 64 * KiB, dtype=np.uint8)
        t = StagedTransport(
            MemoryTransport(name, fabric),
            pool_bytes=4 * KiB,
            chunk_bytes=KiB,
            copier=copier if name == "a" else None,
            probe_interval_s=probe_interval_s,
        )
        layout = host_layout(buf, num_blocks=16, block_size=1, num_regions=4)
        t.register(layout)
        ts.append(t)
        layouts.append(layout)
        bufs.append(buf)
    ts[0].connect("b", ts[1].local_metadata())
    ts[1].connect("a", ts[0].local_metadata())
    return fabric, ts, [layouts, bufs]


def test_a_stage_whose_lengths_wrap_int64_is_refused_not_copied() -> None:
    """Bug fixed with the shared interval checks: two runs of 2**63-1 bytes pass `addr + length <= end`
    (the sum wraps negative) and the chunk's total (numpy's sum wraps to 14): the old responder then
    memmoved 2**63 bytes. A run ending exactly at a region's end is still served."""
    from kv_connectors.transports.staging.messages import ENC, Stage, pack_runs

    copier = _RecordingCopier()
    fabric, (a, b), (layouts, _) = _memory_pair(copier)
    region = layouts[0].regions[0]
    base, end = region.base, region.base + region.span
    huge = (1 << 63) - 1
    hostile = pack_runs(np.array([base, base, base], np.int64), np.array([huge, huge, 16], np.int64))
    fabric.agents["b"].send_notif("a", staging.MSG_MAGIC + ENC.encode([Stage(1, 0, hostile)]))
    a.progress()
    assert copier.pairs == [] and a.pool_stats()["slots_in_use"] == 0 and a.pool_stats()["queued"] == 0
    edge = pack_runs(np.array([end - 100], np.int64), np.array([100], np.int64))  # ends exactly at the end
    fabric.agents["b"].send_notif("a", staging.MSG_MAGIC + ENC.encode([Stage(2, 0, edge)]))
    a.progress()
    assert [(src, n) for _, src, n in copier.pairs] == [(end - 100, 100)]
    a.close()
    b.close()


def test_a_peer_that_dies_while_we_serve_it_frees_our_slots() -> None:
    """Bug fixed with the peer table: a peer we only serve (its READ holds our slots, waiting for its
    FREE) that dies silently was probed, the probe failed, and nothing happened: its slots stayed
    held for good (the failure only failed transfers of ours, and there were none)."""
    fabric, (a, b), (layouts, _) = _memory_pair(probe_interval_s=0.05)
    plan = plan_transfer(layouts[0], list(range(8)), layouts[1], list(range(8)))
    handle = b.post_read("a", plan, b"")
    a.progress()  # serves b's STAGEs: gathers, sends READY, holds the slots until b's FREE
    assert a.pool_stats()["slots_in_use"] >= 1
    fabric.dead.add("b")
    deadline = time.monotonic() + 5.0
    while a.pool_stats()["slots_in_use"] or a.pool_stats()["queued"]:
        assert time.monotonic() < deadline, f"slots still held for a dead peer: {a.pool_stats()}"
        a.progress()
        time.sleep(0.01)
    with pytest.raises(PeerDisconnectedError):  # and it is gone for us until it connects again
        a.post_read("b", plan_transfer(layouts[1], [0], layouts[0], [0]), b"")
    b.release(handle)
    a.close()
    b.close()


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def kind(request: Any) -> str:
    return request.param


@pytest.fixture(scope="module")
def peers(kind: str) -> Iterator[list[Peer]]:
    started = start_peers([spec(kind, f"p1-{kind}", 1), spec(kind, f"p2-{kind}", 2)], WAIT_S)
    try:
        yield started
    finally:
        stop_peers(started)


@pytest.fixture
def local(kind: str, peers: list[Peer]) -> Iterator[Local]:
    for p in peers:
        assert p.call("reset", p.seed) == "ok"
    loc = open_local(local_spec(kind), peers)
    yield loc
    loc.close()


# Chunking (no engine) ------------------------------------------------------------------------
def test_chunking_splits_runs_at_chunk_boundaries() -> None:
    plan = plan_of_runs([(0x1000, 0x9000, 100), (0x5000, 0xA000, 300), (0x8000, 0xB000, 0), (0x8100, 0xB100, 50)])
    ch = chunk_plan(plan, chunk_bytes=128, max_runs=1024)
    assert ch.num_chunks == 4  # ceil(450 / 128): chunks are filled, a run crosses chunk boundaries
    assert [ch.nbytes(k) for k in range(4)] == [128, 128, 128, 66]
    assert ch.src.tolist() == [0x1000, 0x5000, 0x5000 + 28, 0x5000 + 156, 0x5000 + 284, 0x8100]
    assert ch.dst.tolist() == [0x9000, 0xA000, 0xA000 + 28, 0xA000 + 156, 0xA000 + 284, 0xB100]
    assert ch.length.tolist() == [100, 28, 128, 128, 16, 50]
    assert ch.slot_off.tolist() == [0, 100, 0, 0, 0, 16]  # pieces packed from the slot's start
    assert ch.bounds.tolist() == [0, 2, 3, 4, 6]


@pytest.mark.parametrize("chunk_bytes,max_runs", [(13, 1024), (7, 3), (4096, 1024), (4096, 2), (10**9, 5)])
def test_chunking_preserves_bytes(chunk_bytes: int, max_runs: int) -> None:
    rng = np.random.default_rng(chunk_bytes + max_runs)
    n = 200
    length = rng.integers(0, 3000, n)
    length[::17] = 0  # empty runs are dropped
    src = np.cumsum(rng.integers(3000, 9000, n)) + 10**6
    dst = rng.permutation(n) * 10**4 + 5 * 10**8
    ch = chunk_plan(TransferPlan(src, dst, length, n), chunk_bytes, max_runs)
    np.testing.assert_array_equal(bytes_covered(ch.src, ch.length), bytes_covered(src, length))
    np.testing.assert_array_equal(bytes_covered(ch.dst, ch.length), bytes_covered(dst, length))
    assert (ch.length > 0).all()
    starts = ch.bounds[:-1]
    sizes = np.add.reduceat(ch.length, starts)
    assert sizes.sum() == length.sum() and sizes.max() <= chunk_bytes
    assert ((np.diff(ch.bounds) > 0) & (np.diff(ch.bounds) <= max_runs)).all()
    before = np.cumsum(ch.length) - ch.length  # pieces are packed from their slot's start
    chunk_of = np.repeat(np.arange(ch.num_chunks), np.diff(ch.bounds))
    np.testing.assert_array_equal(ch.slot_off, before - before[starts][chunk_of])
    if max_runs >= 1024:
        assert ch.num_chunks == -(-int(length.sum()) // chunk_bytes)  # no chunk left part-empty


def test_chunking_empty_plan() -> None:
    assert chunk_plan(plan_of_runs([]), 64, 8).num_chunks == 0
    assert chunk_plan(plan_of_runs([(1, 2, 0)]), 64, 8).num_chunks == 0


def test_bad_configuration() -> None:
    with pytest.raises(ConfigError, match="at least 2 slots"):
        StagedTransport(None, pool_bytes=100, chunk_bytes=64)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        StagedTransport(None, pool_bytes=100, chunk_bytes=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        StagedTransport(None, pool_bytes=1024, chunk_bytes=64, probe_interval_s=0)  # type: ignore[arg-type]


# Real engines --------------------------------------------------------------------------------
def test_read_through_a_small_pool(local: Local) -> None:
    p, t = local.peers[0], local.transport
    src_ids, dst_ids = pick_blocks(seed=3)
    plan = plan_transfer(p.layout, src_ids, local.layout, dst_ids)
    assert plan.total_bytes == 4 * MiB and plan.length.max() > CHUNK  # some run is split into chunks
    expected = [a.copy() for a in local.storage]
    block_copy(expected, kv(p.seed), src_ids, dst_ids)
    base = t.pool.data_ptr()

    handle = t.post_read(p.name, plan, b"read-done")
    assert handle.num_chunks >= plan.total_bytes // CHUNK
    wait_all(t, [handle])
    for got, want in zip(local.storage, expected):  # every copied byte right, every other byte untouched
        np.testing.assert_array_equal(got, want)
    p.wait_notif(t.name, b"read-done")
    check_pool(local)
    assert t.pool.data_ptr() == base and t.pool_stats()["bytes_staged"] == plan.total_bytes
    stats = p.wait_idle()
    assert 2 <= stats["peak_slots_in_use"] <= stats["slots"] and stats["bytes_staged"] >= plan.total_bytes
    assert t.get_notifs() == []  # staging messages never reach the user


def test_write_through_a_small_pool(local: Local) -> None:
    p, t = local.peers[0], local.transport
    src_ids, dst_ids = pick_blocks(seed=4)
    plan = plan_transfer(local.layout, src_ids, p.layout, dst_ids)
    assert plan.total_bytes == 4 * MiB
    expected = kv(p.seed)
    block_copy(expected, local.storage, src_ids, dst_ids)

    wait_all(t, [t.post_write(p.name, plan, b"write-done")])
    seen = p.wait_notif(t.name, b"write-done")
    assert seen == storage_digest(expected)  # the peer's KV cache was final when the notification came
    for got, want in zip(p.call("dump"), expected):
        np.testing.assert_array_equal(got, want)
    check_pool(local)
    p.wait_idle()


def test_concurrent_transfers_share_the_pool(local: Local) -> None:
    """Three transfers with two peers at once: all progress together through the 4 slots."""
    p1, p2 = local.peers
    t = local.transport
    # Disjoint blocks: what one transfer writes, no other reads or writes.
    r1 = pick_blocks(seed=5, n=100, dst_pool=range(0, 100))
    r2 = pick_blocks(seed=6, n=100, src_pool=range(160, NB), dst_pool=range(100, 200))
    w2 = pick_blocks(seed=7, n=100, src_pool=range(200, NB), dst_pool=range(0, 160))
    expected = [a.copy() for a in local.storage]
    block_copy(expected, kv(p1.seed), *r1)
    block_copy(expected, kv(p2.seed), *r2)
    expected_p2 = kv(p2.seed)
    block_copy(expected_p2, local.storage, *w2)
    handles = [
        t.post_read(p1.name, plan_transfer(p1.layout, r1[0], local.layout, r1[1]), b"r1"),
        t.post_read(p2.name, plan_transfer(p2.layout, r2[0], local.layout, r2[1]), b"r2"),
        t.post_write(p2.name, plan_transfer(local.layout, w2[0], p2.layout, w2[1]), b"w2"),
    ]
    progress_at_first_done: list[list[float]] = []

    def watch() -> None:
        if not progress_at_first_done and any(h.chunks_done == h.num_chunks for h in handles):
            progress_at_first_done.append([h.chunks_done / h.num_chunks for h in handles])

    wait_all(t, handles, on_poll=watch)
    assert progress_at_first_done and min(progress_at_first_done[0]) > 0.25, progress_at_first_done  # fair turns
    for got, want in zip(local.storage, expected):
        np.testing.assert_array_equal(got, want)
    p1.wait_notif(t.name, b"r1")
    p2.wait_notif(t.name, b"r2")
    assert p2.wait_notif(t.name, b"w2") == storage_digest(expected_p2)
    check_pool(local)
    p1.wait_idle()
    p2.wait_idle()


def test_both_ways_through_two_slots(kind: str, peers: list[Peer]) -> None:
    """We pull from the peer while it pulls from us, our pool holding only 2 slots: one slot is
    always kept for serving, so neither side can end up waiting on the other for ever."""
    p = peers[0]
    assert p.call("reset", p.seed) == "ok"
    loc = open_local(local_spec(kind, pool=2 * CHUNK), [p])
    try:
        t = loc.transport
        ours = pick_blocks(seed=14, n=128, src_pool=range(0, 160), dst_pool=range(0, 160))
        theirs = pick_blocks(seed=15, n=128, src_pool=range(160, NB), dst_pool=range(160, NB))
        expected = [a.copy() for a in loc.storage]
        block_copy(expected, kv(p.seed), *ours)
        expected_p = kv(p.seed)
        block_copy(expected_p, loc.storage, *theirs)
        assert p.call("read", t.name, loc.layout, theirs[0], theirs[1], b"theirs") == "ok"
        wait_all(t, [t.post_read(p.name, plan_transfer(p.layout, ours[0], loc.layout, ours[1]), b"ours")])
        deadline = time.monotonic() + WAIT_S
        while (p.name, b"theirs") not in t.get_notifs():  # the peer's pull is served by our progress
            assert time.monotonic() < deadline, "the peer's pull did not finish"
            time.sleep(0.001)
        for got, want in zip(loc.storage, expected):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(p.call("dump"), expected_p):
            np.testing.assert_array_equal(got, want)
        stats = t.pool_stats()
        assert stats["slots"] == 2 and stats["peak_slots_in_use"] == 2
        p.wait_notif(t.name, b"ours")
        wait_slots_free(t)
    finally:
        loc.close()


def test_release_aborts_and_frees_slots(local: Local) -> None:
    p, t = local.peers[0], local.transport
    src_ids, dst_ids = pick_blocks(seed=8)
    plan = plan_transfer(p.layout, src_ids, local.layout, dst_ids)
    handle = t.post_read(p.name, plan, b"never")
    deadline = time.monotonic() + WAIT_S
    while handle.chunks_done < 2:
        assert t.poll(handle) is XferState.IN_PROGRESS and time.monotonic() < deadline
        time.sleep(0.0002)
    t.release(handle)
    t.release(handle)  # twice: still never raises
    with pytest.raises(TransportError, match="released"):
        t.poll(handle)
    wait_slots_free(t)
    p.wait_idle()  # the peer heard of the abort and freed its slots
    expected = [a.copy() for a in local.storage]
    block_copy(expected, kv(p.seed), src_ids, dst_ids)
    wait_all(t, [t.post_read(p.name, plan, b"again")])  # the pool and the peer are healthy
    for got, want in zip(local.storage, expected):
        np.testing.assert_array_equal(got, want)
    p.wait_notif(t.name, b"again")
    assert (t.name, b"never", storage_digest(kv(p.seed))) not in p.inbox


def test_peer_error_and_local_checks(local: Local) -> None:
    p, t = local.peers[0], local.transport
    outside = p.layout.regions[0].base + 10**9
    bad = TransferPlan(np.array([outside]), np.array([local.layout.regions[0].base]), np.array([4096]), 1)
    handle = t.post_read(p.name, bad, b"")
    with pytest.raises(TransportError, match="not inside registered KV memory"):
        wait_all(t, [handle])
    wait_slots_free(t)
    p.wait_idle()
    with pytest.raises(TransportError, match="local side"):  # our own addresses are checked at once
        t.post_write(p.name, TransferPlan(np.array([outside]), np.array([0]), np.array([8]), 1), b"")
    with pytest.raises(TransportError, match="not connected"):
        t.post_read("nobody", bad, b"")
    with pytest.raises(TransportError, match="StagedTransport"):
        t.connect("plain", b"not staging metadata")


def test_user_notifications_pass_through(local: Local) -> None:
    p, t = local.peers[0], local.transport
    tricky = staging._MSG_MAGIC + b"user bytes that look like staging"
    t.send_notif(p.name, b"hello")
    t.send_notif(p.name, tricky)
    p.wait_notif(t.name, b"hello")
    p.wait_notif(t.name, tricky)
    empty = TransferPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    handle = t.post_read(p.name, empty, b"empty")
    assert t.poll(handle) is XferState.DONE
    p.wait_notif(t.name, b"empty")


@pytest.mark.parametrize("when", ["moving", "frozen"])
def test_peer_killed_mid_transfer(kind: str, when: str) -> None:
    """READ and WRITE by us and a READ by the peer in flight; the peer dies (while moving data, or
    frozen, when only the liveness probe can notice): our transfers fail with a typed error within
    seconds, and every slot is freed (ours, and those we held serving the peer's READ)."""
    chunk = 8 * KiB  # 512 chunks per transfer: the peer dies long before the end
    peers: list[Peer] = []
    loc = None
    try:
        peers = start_peers([spec(kind, f"k-{kind}-{when}", 9, pool=8 * chunk, chunk=chunk)], WAIT_S)
        p = peers[0]
        loc = open_local(local_spec(kind, pool=8 * chunk, chunk=chunk), peers)
        t = loc.transport
        r, w, theirs = pick_blocks(seed=10), pick_blocks(seed=11), pick_blocks(seed=12)
        handles = [
            t.post_read(p.name, plan_transfer(p.layout, r[0], loc.layout, r[1]), b""),
            t.post_write(p.name, plan_transfer(loc.layout, w[0], p.layout, w[1]), b""),
        ]
        assert p.call("read", t.name, loc.layout, theirs[0], theirs[1], b"") == "ok"
        deadline = time.monotonic() + WAIT_S
        while min(h.chunks_done for h in handles) < 2 or t.pool_stats()["slots_in_use"] < 2:
            assert all(t.poll(h) is XferState.IN_PROGRESS for h in handles) and time.monotonic() < deadline
            time.sleep(0.0002)
        if when == "frozen":  # our in-flight moves end; then only the liveness probe can tell
            assert p.call("pause", 60.0) == "ok"
            quiet = time.monotonic() + 0.3
            while time.monotonic() < quiet:
                assert all(t.poll(h) is XferState.IN_PROGRESS for h in handles)
                time.sleep(0.001)
        os.kill(p.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        errors: dict[int, TransportError] = {}
        while len(errors) < len(handles):
            for i, h in enumerate(handles):
                if i not in errors:
                    try:
                        assert t.poll(h) is XferState.IN_PROGRESS, "a transfer finished after the peer died"
                    except TransportError as e:
                        errors[i] = e
            assert time.monotonic() - killed < FAULT_DEADLINE_S, f"no error within {FAULT_DEADLINE_S} s"
            time.sleep(0.001)
        for e in errors.values():
            assert isinstance(e, PeerDisconnectedError), repr(e)
            assert when == "moving" or "liveness probe" in str(e), repr(e)
        wait_slots_free(t)  # ours, and those we held for the peer's READ
        for h in handles:
            t.release(h)
        print(f"{kind} {when}: errors after {time.monotonic() - killed:.2f} s: {list(errors.values())}")
        with pytest.raises(PeerDisconnectedError):  # a dead peer stays dead ...
            t.post_read(p.name, plan_transfer(p.layout, r[0], loc.layout, r[1]), b"")
        if when == "moving":  # ... until it restarts and we connect to the new incarnation
            peers += start_peers([spec(kind, p.name, 13, pool=8 * chunk, chunk=chunk)], WAIT_S)
            again = peers[-1]
            t.connect(again.name, again.metadata)
            assert again.call("connect", t.name, t.local_metadata()) == "ok"
            expected = [a.copy() for a in loc.storage]
            block_copy(expected, kv(13), *r)
            wait_all(t, [t.post_read(again.name, plan_transfer(again.layout, r[0], loc.layout, r[1]), b"back")])
            for got, want in zip(loc.storage, expected):
                np.testing.assert_array_equal(got, want)
            again.wait_notif(t.name, b"back")
    finally:
        if loc is not None:
            loc.close()
        stop_peers(peers)


# CUDA (exercised where a GPU is present; elsewhere the refusal is what is checked) --------------
def test_cuda_copier() -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(TransportUnavailableError):
            staging.CudaCopier(0)
        return
    dev = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    dev.add_(1)  # queued on the compute stream: the copier must order itself after it
    host = torch.zeros(1 << 16, dtype=torch.uint8, pin_memory=True)
    copier = staging.CudaCopier(0)
    copier.copy([(host.data_ptr(), dev.data_ptr() + 4096, 8192), (host.data_ptr() + 8192, dev.data_ptr(), 4096)])
    copier.synchronize()
    want = dev.cpu()
    assert torch.equal(host[:8192], want[4096:12288]) and torch.equal(host[8192:12288], want[:4096])
    back = torch.zeros_like(dev)
    copier.copy([(back.data_ptr() + 100, host.data_ptr(), 12288)])
    copier.synchronize()
    assert torch.equal(back[100:12388].cpu(), host[:12288]) and int(back[:100].sum()) == 0


def test_device_kv_through_a_pinned_pool(kind: str, peers: list[Peer]) -> None:
    """DEVICE memory: gather/scatter with CudaCopier into a pinned pool; only the pool is registered."""
    import torch

    if not torch.cuda.is_available():
        t = open_transport(spec(kind, f"dev{next(_names)}-{os.getpid()}"))
        with t, pytest.raises(TransportUnavailableError):
            t.register(layout_of(kv(100)), MemoryKind.DEVICE, 0)
        assert t.pool is None
        return
    p = peers[0]
    assert p.call("reset", p.seed) == "ok"
    host = kv(100)
    dev = [torch.from_numpy(a).cuda() for a in host]
    layout = layout_of(dev)  # the same views as on the host: the padding is not KV
    t = open_transport(spec(kind, f"dev{next(_names)}-{os.getpid()}"))
    try:
        t.register(layout, MemoryKind.DEVICE, 0)
        assert t.pool.is_pinned()
        t.connect(p.name, p.metadata)
        assert p.call("connect", t.name, t.local_metadata()) == "ok"
        src_ids, dst_ids = pick_blocks(seed=16)
        expected = [a.copy() for a in host]
        block_copy(expected, kv(p.seed), src_ids, dst_ids)
        wait_all(t, [t.post_read(p.name, plan_transfer(p.layout, src_ids, layout, dst_ids), b"to-gpu")])
        for got, want in zip(dev, expected):
            np.testing.assert_array_equal(got.cpu().numpy(), want)
        p.wait_notif(t.name, b"to-gpu")
        back = pick_blocks(seed=17)
        expected_p = kv(p.seed)
        block_copy(expected_p, expected, *back)
        wait_all(t, [t.post_write(p.name, plan_transfer(layout, back[0], p.layout, back[1]), b"from-gpu")])
        assert p.wait_notif(t.name, b"from-gpu") == storage_digest(expected_p)
    finally:
        if p.proc.is_alive():
            p.call("disconnect", t.name)
        t.close()
