"""NixlTransport against the real NIXL engine: a peer process on 127.0.0.1, bytes verified, faults typed."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kv_connectors.errors import ConfigError, PeerDisconnectedError, TransportError
from kv_connectors.nixl.transport import NixlTransport
from kv_connectors.plan import plan_transfer
from kv_connectors.transports.base import XferState
from kvc_testing import kvbuffers
from kvc_testing.peers import Local, Peer, PeerSpec, open_local, peer_starter
from tests.transports.helpers import random_pairs, read_until_error, wait_done

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("loopback_env")]

WAIT_S = 10.0
FAULT_DEADLINE_S = 5.0


@pytest.fixture
def start_peer() -> Iterator[Callable[..., Peer]]:
    with peer_starter("nixl", WAIT_S) as start:
        yield start


@pytest.fixture
def local() -> Iterator[Local]:
    loc = open_local(PeerSpec("nixl", f"d-{os.getpid()}", seed=100))
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
    assert (handle.num_runs, handle.nbytes) == (plan.num_runs, plan.total_bytes)
    wait_done(t, handle, WAIT_S)
    for got, want in zip(local.storage, expected):  # copied blocks right, all other bytes untouched
        np.testing.assert_array_equal(got, want)
    p.wait_notif(t.name, b"read-1")
    assert p.call("dump")[0].tobytes() == kvbuffers.make_kv(seed=1)[0].tobytes()  # source unchanged


def test_write_random_blocks(local: Local, start_peer: Any) -> None:
    p = start_peer(seed=2)
    t = local.transport
    t.connect(p.name, p.metadata)
    src_ids, dst_ids = random_pairs(np.random.default_rng(1), kvbuffers.SMALL_BLOCKS)
    plan = plan_transfer(local.layout, src_ids, p.layout, dst_ids)
    assert len(local.layout.regions) < plan.num_runs < len(local.layout.regions) * len(src_ids)
    expected = kvbuffers.make_kv(seed=2)
    kvbuffers.block_copy(expected, local.storage, src_ids, dst_ids)

    wait_done(t, t.post_write(p.name, plan, b"write-1"), WAIT_S)
    p.wait_notif(t.name, b"write-1")  # the notif follows the data: the peer's bytes are final now
    for got, want in zip(p.call("dump"), expected):
        np.testing.assert_array_equal(got, want)


def test_empty_plan_delivers_notif(local: Local, start_peer: Any) -> None:
    p = start_peer()
    t = local.transport
    t.connect(p.name, p.metadata)
    before = [a.copy() for a in local.storage]
    read = t.post_read(p.name, plan_transfer(p.layout, [], local.layout, []), b"empty-read")
    assert t.poll(read) is XferState.DONE
    t.release(read)
    write = t.post_write(p.name, plan_transfer(local.layout, [], p.layout, []), b"empty-write")
    assert t.poll(write) is XferState.DONE
    t.release(write)
    p.wait_notif(t.name, b"empty-read")
    p.wait_notif(t.name, b"empty-write")
    assert all(np.array_equal(a, b) for a, b in zip(before, local.storage))


def test_notifs_and_unknown_peer(local: Local, start_peer: Any) -> None:
    p = start_peer()
    t = local.transport
    plan = plan_transfer(p.layout, [0], local.layout, [0])
    with pytest.raises(TransportError, match="not connected"):
        t.post_read(p.name, plan, b"x")
    with pytest.raises(TransportError):
        t.send_notif(p.name, b"x")
    t.connect(p.name, p.metadata)
    t.connect(p.name, p.metadata)  # same incarnation again: a no-op
    t.send_notif(p.name, b"hello")
    p.wait_notif(t.name, b"hello")
    assert t.get_notifs() == []
    t.disconnect(p.name)
    t.disconnect("nobody")
    with pytest.raises(TransportError):
        t.post_read(p.name, plan, b"x")


def test_peer_killed_before_read(local: Local, start_peer: Any) -> None:
    p = start_peer()
    t = local.transport
    t.connect(p.name, p.metadata)
    plan = plan_transfer(p.layout, [1, 2, 7], local.layout, [4, 5, 9])
    wait_done(t, t.post_read(p.name, plan, b""), WAIT_S)  # connection is up
    p.kill()
    started = time.monotonic()
    err, _ = read_until_error(t, p.name, plan, started + FAULT_DEADLINE_S)
    assert isinstance(err, PeerDisconnectedError), repr(err)
    assert time.monotonic() - started < FAULT_DEADLINE_S
    t.disconnect(p.name)


@pytest.mark.parametrize("num_threads", [None, 2], ids=["inline-copy", "threads-2"])
def test_peer_killed_while_reading(start_peer: Any, num_threads: int | None) -> None:
    """Default: UCX copies inside post, so the kill shows at a post; with worker threads posts
    return at once and the kill also shows in poll."""
    storage = kvbuffers.make_kv(seed=7, profile="big")
    layout = kvbuffers.layout_of(storage)
    p = start_peer(seed=8, profile="big")
    with NixlTransport(f"d-big-{os.getpid()}", num_threads=num_threads) as t:
        t.register(layout)
        t.connect(p.name, p.metadata)
        ids = np.random.default_rng(3).permutation(kvbuffers.BIG_BLOCKS)
        plan = plan_transfer(p.layout, ids, layout, np.random.default_rng(4).permutation(kvbuffers.BIG_BLOCKS))
        assert plan.num_runs > kvbuffers.BIG_BLOCKS // 2
        killer = threading.Timer(0.5, lambda: os.kill(p.proc.pid, signal.SIGKILL))
        killer.start()
        try:
            err, done = read_until_error(t, p.name, plan, time.monotonic() + 0.5 + FAULT_DEADLINE_S)
        finally:
            killer.cancel()
        assert isinstance(err, TransportError), repr(err)
        print(f"killed after {done} full reads: {err!r}")
    p.proc.join(WAIT_S)


def test_reconnect_restarted_peer(local: Local, start_peer: Any) -> None:
    t = local.transport
    first = start_peer(name="p", seed=11)
    t.connect("p", first.metadata)
    plan = plan_transfer(first.layout, [0, 1, 2], local.layout, [5, 6, 7])
    wait_done(t, t.post_read("p", plan, b"one"), WAIT_S)
    first.wait_notif(t.name, b"one")
    first.kill()

    second = start_peer(name="p", seed=12)  # same name, new memory and new UCX address
    assert second.metadata != first.metadata
    t.connect("p", second.metadata)
    plan = plan_transfer(second.layout, [8, 9, 30], local.layout, [5, 6, 7])
    expected = [a.copy() for a in local.storage]
    kvbuffers.block_copy(expected, kvbuffers.make_kv(seed=12), [8, 9, 30], [5, 6, 7])
    wait_done(t, t.post_read("p", plan, b"two"), WAIT_S)
    for got, want in zip(local.storage, expected):
        np.testing.assert_array_equal(got, want)
    second.wait_notif(t.name, b"two")


def test_idle_agent_does_not_spin() -> None:
    """With a progress delay the progress thread sleeps; with pthrDelay 0 it burns a core."""
    with NixlTransport(f"idle-{os.getpid()}", progress_delay_us=1000):
        time.sleep(0.2)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert cpu < 0.3, f"idle NIXL agent used {cpu:.2f} of a core"


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        NixlTransport("x", progress_delay_us=-1)
    with pytest.raises(ConfigError):
        NixlTransport("x", num_threads=0)
    with pytest.raises(ConfigError):
        NixlTransport("")
    t = NixlTransport(f"closed-{os.getpid()}")
    t.close()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.get_notifs()


def test_process_with_an_agent_exits_cleanly():
    """nixl's bundled libnl next to the system's (installed for Mooncake) crashed at exit (SIGSEGV)."""
    import subprocess

    code = "from kv_connectors.nixl.transport import NixlTransport\nt = NixlTransport('exit-check'); t.close()\n"
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]


def test_cuda_ipc_get_is_enabled_only_where_an_nvidia_device_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX turns cuda_ipc GET off without NVLink and a pull of same-node VRAM crawls (0.5 GB/s on an H200)."""
    import types

    from kv_connectors.nixl import ucx as nt

    var = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    monkeypatch.delenv(var, raising=False)
    devices: list[str] = []
    monkeypatch.setattr(nt, "Path", lambda _: types.SimpleNamespace(glob=lambda _pat: iter(devices)))
    nt.enable_cuda_ipc_get()
    assert var not in os.environ  # no GPU: UCX would warn that the variable is unused
    devices.append("/dev/nvidia0")
    nt.enable_cuda_ipc_get()
    assert os.environ[var] == "yes"
    monkeypatch.setenv(var, "no")
    nt.enable_cuda_ipc_get()
    assert os.environ[var] == "no"  # the user's choice stands


def test_tcp_segments_default_to_32k_and_the_users_value_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    """At UCX's 8 KiB a READ over TCP ran at ~0.6 of a plain socket (32 KiB: 0.9-1.0, bench_transport)."""
    from kv_connectors.nixl import ucx as nt

    var = "UCX_TCP_TX_SEG_SIZE"
    monkeypatch.delenv(var, raising=False)
    nt.larger_tcp_segments()
    assert os.environ[var] == nt.TCP_TX_SEG_SIZE == "32k"
    monkeypatch.setenv(var, "8k")
    nt.larger_tcp_segments()
    assert os.environ[var] == "8k"


def test_a_nixl_agent_is_created_with_the_tcp_segment_default() -> None:
    """The default is in place before UCX starts: an agent in a fresh process with UCX restricted
    to TCP comes up with the variable set (UCX reads it once, at init)."""
    import subprocess

    code = (
        "import os\nfrom kv_connectors.nixl.transport import NixlTransport\n"
        "t = NixlTransport('tcp-seg-check'); print('SEG=' + os.environ['UCX_TCP_TX_SEG_SIZE']); t.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_TCP_TX_SEG_SIZE"}
    env.update(UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert "SEG=32k" in proc.stdout.decode().split()
