"""One peer harness for the transport tests, the transport contract suite and the transport benchmarks.

- Transports: `open_transport(spec)` builds any kind through `create_transport` (the one factory the
  connectors use), wrapped in a `StagedTransport` where the spec asks for a pool; a spec's KV cache
  (`kv_of`) is one of kvc_testing/kvbuffers.py's: a test profile or the benchmarks' word pattern.
- The peer: `Server` holds one transport over one KV cache and answers commands; `serve` runs it in
  a spawned process over a pipe (`start_peers` / `stop_peers` / `Peer`), `InProcessPeer` runs it in
  this process (the memory transport, whose fabric cannot cross a process).
- The caller's own side: `open_local` (a transport over a patterned KV cache, connected both ways).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kv_connectors.config import ConnectorConfig, Role
from kv_connectors.errors import TransportError
from kv_connectors.hugepages import back_with_huge_pages
from kv_connectors.layout import KVLayout
from kv_connectors.plan import plan_transfer
from kv_connectors.transports import create_transport, ucx_on_loopback
from kv_connectors.transports.base import MemoryKind, Transport, XferState
from kv_connectors.transports.staging.direct import FragmentRule
from kvc_testing.kvbuffers import Shape, bench_kv, bench_layout, check_pattern, layout_of, make_kv, storage_digest

logger = logging.getLogger(__name__)

_CTX = mp.get_context("spawn")
STARTUP_S = 60.0  # a spawned peer imports numpy, torch and an engine: slow on a loaded 2-core machine
STOP_S = 5.0


# Transports ----------------------------------------------------------------------------------
class SkipCopier:
    """A staging copier that copies nothing (benchmarks only: bytes are NOT moved between the KV cache
    and the pool). It times the staging pipeline alone (messages, slots, the pool-to-pool move) as if
    the gather and scatter took no CPU, which is what a GPU's copy engine approaches."""

    def copy(self, pairs: Any) -> None:
        """Nothing is copied."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """One transport over one KV cache.

    Transport: engine kind (any of kv_connectors.transports.KINDS; "memory" only in this process),
    its name, the engine knobs, and, where pool > 0, a StagedTransport of pool bytes in chunk-byte
    slots around it (liveness probe every probe_s). KV: a test profile filled from seed, or, where
    shape is set, the benchmark word pattern ("pattern") or sentinels ("sentinel") on device."""

    kind: str
    name: str
    seed: int = 1
    profile: str = "small"
    pool: int = 0
    chunk: int = 0
    probe_s: float = 0.5
    progress_delay_us: int = 1000
    num_threads: int | None = None
    max_batch: int = 1000
    protocol: str = "tcp"
    shape: Shape | None = None
    device: str = "cpu"
    fill: str = "pattern"
    idle: float | None = None  # seconds between progress steps while no command comes
    digest_notifs: bool = True  # take storage_digest() at each notification (tests; too slow for benchmarks)
    host: str = "127.0.0.1"  # this peer's address (Mooncake's hostname)
    netns: str = ""  # a network namespace (kvc_testing.netns) the peer process enters first
    copies: str = "real"  # staging: "skip" = a SkipCopier (the pipeline timed without its copies)
    huge_pages: bool = True  # host KV on huge pages, as the connector registers it (config host_huge_pages)
    fragments: FragmentRule | None = None  # staging "fragmented": the KV registered too, this rule picks staged plans

    @property
    def idle_s(self) -> float:
        """How long a peer process waits for a command between progress steps (a staging peer
        takes part in every chunk of its peers' transfers, so it progresses often)."""
        if self.idle is not None:
            return self.idle
        return 0.0005 if self.pool else 0.002 if self.kind == "mooncake" else 0.005

    @property
    def memory_kind(self) -> MemoryKind:
        return MemoryKind.DEVICE if self.device.startswith("cuda") else MemoryKind.HOST


def engine_config(spec: PeerSpec) -> ConnectorConfig:
    """The connector config create_transport reads the spec's engine knobs from."""
    return ConnectorConfig(
        engine_id=spec.name,
        role=Role.BOTH,
        progress_delay_us=spec.progress_delay_us,
        nixl_num_threads=ConnectorConfig.nixl_num_threads if spec.num_threads is None else spec.num_threads,
        mooncake_protocol=spec.protocol,
        side_channel_host=spec.host,
    )


def open_transport(spec: PeerSpec, **kwargs: Any) -> Transport:
    """The spec's transport, not yet registered (kwargs go to the engine: the memory transport's fabric)."""
    if spec.kind == "mooncake":
        kwargs.setdefault("max_batch", spec.max_batch)
    inner = create_transport(spec.kind, spec.name, engine_config(spec), **kwargs)
    if not spec.pool:
        return inner
    from kv_connectors.transports.staging import StagedTransport

    try:
        copier = SkipCopier() if spec.copies == "skip" else None
        return StagedTransport(
            inner,
            pool_bytes=spec.pool,
            chunk_bytes=spec.chunk,
            probe_interval_s=spec.probe_s,
            copier=copier,
            fragments=spec.fragments,
        )
    except BaseException:
        inner.close()
        raise


def kv_of(spec: PeerSpec) -> tuple[list[Any], KVLayout]:
    """The spec's KV cache and its layout."""
    if spec.shape is not None:
        kv = bench_kv(spec.shape, spec.device, spec.fill)
        layout = bench_layout(kv, spec.shape)
        if spec.huge_pages and spec.memory_kind is MemoryKind.HOST:
            back_with_huge_pages((r.base, r.span) for r in layout.regions)
        return kv, layout
    storage = make_kv(spec.seed, spec.profile)
    return storage, layout_of(storage)


# The peer ------------------------------------------------------------------------------------
class Server:
    """A peer: one registered transport and its KV cache; each cmd_* answers one command."""

    def __init__(self, spec: PeerSpec, **kwargs: Any) -> None:
        self.spec = spec
        self.storage, self.layout = kv_of(spec)
        self.t = open_transport(spec, **kwargs)
        try:
            self.t.register(self.layout, spec.memory_kind, 0)
        except BaseException:
            self.t.close()
            raise
        self.notifs: list[tuple[str, bytes, str]] = []
        self.handles: list[Any] = []
        self.paused_until = 0.0
        self.closed = False

    def step(self) -> None:
        """Collect notifications and progress our own transfers, unless paused or closed."""
        if self.closed or time.monotonic() < self.paused_until:
            return
        got = self.t.get_notifs()
        if got:
            digest = storage_digest(self.storage) if self.spec.digest_notifs else ""
            self.notifs.extend((peer, msg, digest) for peer, msg in got)
        for h in list(self.handles):
            try:
                if self.t.poll(h) is XferState.DONE:
                    self.handles.remove(h)
                    self.t.release(h)
            except TransportError:
                self.handles.remove(h)
                self.t.release(h)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.t.close()

    def cmd_notifs(self) -> list[tuple[str, bytes, str]]:
        self.step()
        out, self.notifs = self.notifs, []
        return out

    def cmd_dump(self) -> list[np.ndarray]:
        return [a.copy() for a in self.storage]

    def cmd_stats(self) -> dict[str, int]:
        return self.t.pool_stats()  # type: ignore[attr-defined, no-any-return]

    def cmd_connect(self, name: str, metadata: bytes) -> str:
        self.t.connect(name, metadata)
        return "ok"

    def cmd_disconnect(self, name: str) -> str:
        self.t.disconnect(name)
        return "ok"

    def cmd_notify(self, name: str, msg: bytes) -> str:
        self.t.send_notif(name, msg)
        return "ok"

    def cmd_reset(self, seed: int) -> str:
        for a, b in zip(self.storage, make_kv(seed, self.spec.profile)):
            a[...] = b
        return "ok"

    def cmd_pause(self, seconds: float) -> str:
        self.paused_until = time.monotonic() + seconds
        return "ok"

    def cmd_read(self, peer: str, remote: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int], notif: bytes) -> str:
        self.handles.append(self.t.post_read(peer, plan_transfer(remote, src_ids, self.layout, dst_ids), notif))
        return "ok"

    def cmd_verify(self, src_ids: Any, dst_ids: Any) -> str:
        """Benchmark KV: "ok" if block dst_ids[i] holds the pattern of block src_ids[i], else what is wrong."""
        return check_pattern(self.storage, src_ids, dst_ids) or "ok"

    def answer(self, cmd: tuple[Any, ...]) -> Any:
        return getattr(self, f"cmd_{cmd[0]}")(*cmd[1:])


def serve(conn: Connection, spec: PeerSpec) -> None:
    """Peer process body: a Server over spec; reports ("ready", metadata, layout), then progresses
    every spec.idle_s and answers commands (tuples) on conn until ("stop",) or a closed pipe.

    ("notifs",) -> (peer, msg, digest) triples received so far (then cleared): digest is
    storage_digest() taken as soon as the notification was seen (spec.digest_notifs), so a test can
    tell whether the data had landed before it; ("dump",) -> the storage arrays; ("stats",) ->
    pool_stats() (staging); ("connect", name, md) / ("disconnect", name) -> "ok"; ("notify", name,
    msg) -> "ok" once sent; ("reset", seed) -> "ok" (refill); ("pause", s) -> "ok", then no progress
    for s seconds; ("read", peer, remote_layout, src_ids, dst_ids, notif) -> "ok", a pull from peer
    progressed in the loop; ("verify", src_ids, dst_ids) -> "ok" or what is wrong (benchmark KV);
    ("stop",) -> close, "bye". A command that raises answers ("error", repr).
    """
    if spec.netns:
        from kvc_testing import netns

        netns.enter(spec.netns)  # before any engine starts a thread or opens a socket
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback between the processes
    server = None
    try:
        server = Server(spec)
        conn.send(("ready", server.t.local_metadata(), server.layout))
        while True:
            server.step()
            if not conn.poll(spec.idle_s):
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                server.close()
                conn.send("bye")
                return
            try:
                conn.send(server.answer(cmd))
            except TransportError as e:
                conn.send(("error", repr(e)))
    except (EOFError, BrokenPipeError):
        pass  # the driving process went away: just exit
    finally:
        if server is not None:
            server.close()


# Driving peers -------------------------------------------------------------------------------
class _Waits:
    """Waits shared by process and in-process peers (both answer call())."""

    name: str
    wait_s: float
    inbox: list[tuple[str, bytes, str]]

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def wait_notif(self, sender: str, msg: bytes, timeout: float | None = None, on_wait: Callable[[], None] | None = None) -> str:
        """Wait for one notification; returns the peer's storage digest taken when it arrived.
        on_wait runs between checks (progress the caller's own transport there)."""
        timeout = self.wait_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.inbox += self.call("notifs")
            for item in self.inbox:
                if item[:2] == (sender, msg):
                    self.inbox.remove(item)
                    return item[2]
            if on_wait is not None:
                on_wait()
            time.sleep(0.001)
        raise AssertionError(f"peer {self.name} did not get notif {(sender, msg)} within {timeout} s (got {self.inbox})")

    def wait_idle(self, timeout: float | None = None) -> dict[str, int]:
        """A staging peer's pool stats once it holds no slot."""
        deadline = time.monotonic() + (self.wait_s if timeout is None else timeout)
        while True:
            stats = self.call("stats")
            if stats["slots_in_use"] == 0 and stats["queued"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"peer {self.name} still holds slots: {stats}")
            time.sleep(0.01)


@dataclasses.dataclass
class Peer(_Waits):
    """A peer process (serve) and its pipe; wait_s is the default deadline of its waits."""

    name: str
    seed: int
    proc: Any
    conn: Connection
    wait_s: float
    metadata: bytes = b""
    layout: KVLayout | None = None
    inbox: list[tuple[str, bytes, str]] = dataclasses.field(default_factory=list)

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        timeout = self.wait_s if timeout is None else timeout
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name} did not answer {cmd[0]} within {timeout} s")
        return self.conn.recv()

    @property
    def alive(self) -> bool:
        return bool(self.proc.is_alive())

    def step(self) -> None:
        """A peer process progresses on its own."""

    def kill(self) -> None:
        """SIGKILL: the peer disappears without a word."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(self.wait_s)
        assert not self.proc.is_alive()


@dataclasses.dataclass
class InProcessPeer(_Waits):
    """A Server in this process (the memory transport), driven like a Peer: progressed at each call
    and at each step() (the caller's wait loops call it)."""

    name: str
    seed: int
    server: Server
    wait_s: float
    metadata: bytes = b""
    layout: KVLayout | None = None
    inbox: list[tuple[str, bytes, str]] = dataclasses.field(default_factory=list)

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        if cmd[0] == "stop":
            self.server.close()
            return "bye"
        if self.server.closed:
            raise TimeoutError(f"peer {self.name} is closed")
        self.server.step()
        try:
            return self.server.answer(cmd)
        except TransportError as e:
            return ("error", repr(e))

    @property
    def alive(self) -> bool:
        return not self.server.closed

    def step(self) -> None:
        self.server.step()

    def kill(self) -> None:
        """The peer closes its transport (and is gone from the fabric)."""
        self.server.close()


def start_in_process(spec: PeerSpec, wait_s: float, **kwargs: Any) -> InProcessPeer:
    server = Server(spec, **kwargs)
    return InProcessPeer(spec.name, spec.seed, server, wait_s, server.t.local_metadata(), server.layout)


def start_peers(specs: Sequence[PeerSpec], wait_s: float, startup_s: float = STARTUP_S) -> list[Peer]:
    """Start peer processes in parallel and wait until each is ready; the caller stops them with
    stop_peers (on a failed start, those already started are stopped here)."""
    peers: list[Peer] = []
    try:
        for spec in specs:
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(target=serve, args=(child, spec), daemon=True)
            proc.start()
            child.close()
            peers.append(Peer(spec.name, spec.seed, proc, parent, wait_s))
        for p in peers:
            if not p.conn.poll(startup_s):
                raise TimeoutError(f"peer {p.name} did not start within {startup_s} s")
            tag, p.metadata, p.layout = p.conn.recv()
            assert tag == "ready"
    except BaseException:
        stop_peers(peers)
        raise
    return peers


def stop_peers(peers: Sequence[Peer | InProcessPeer]) -> None:
    for p in peers:
        if isinstance(p, InProcessPeer):
            p.call("stop")
            continue
        if p.proc.is_alive():
            try:
                p.call("stop", timeout=STOP_S)
            except (TimeoutError, OSError, EOFError):
                pass
        p.proc.join(STOP_S)
        if p.proc.is_alive():
            p.proc.kill()
            p.proc.join(STOP_S)
        p.conn.close()


@contextlib.contextmanager
def peer_starter(kind: str, wait_s: float) -> Iterator[Callable[..., Peer]]:
    """start(name="p", seed=1, profile="small") -> a ready peer process; all are stopped on exit."""
    peers: list[Peer] = []

    def start(name: str = "p", seed: int = 1, profile: str = "small") -> Peer:
        p = start_peers([PeerSpec(kind, name, seed, profile)], wait_s)[0]
        peers.append(p)
        return p

    try:
        yield start
    finally:
        stop_peers(peers)


loopback_env = ucx_on_loopback  # UCX on loopback (spawned peers inherit it); a value already set is kept


# The caller's own transport ------------------------------------------------------------------
@dataclasses.dataclass
class Local:
    """The caller's transport over its own patterned KV cache, and the peers connected to it."""

    transport: Any
    storage: list[np.ndarray]
    layout: KVLayout
    peers: list[Peer | InProcessPeer] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Peers forget us first (staging peers talk back), then our transport closes."""
        for p in self.peers:
            if p.alive:
                try:
                    p.call("disconnect", self.transport.name, timeout=STOP_S)
                except (TimeoutError, OSError, EOFError):
                    pass
        self.transport.close()


def open_local(spec: PeerSpec, peers: Sequence[Peer | InProcessPeer] = (), **kwargs: Any) -> Local:
    """spec's transport over a fresh KV cache, registered, connected both ways with every peer."""
    storage, layout = kv_of(spec)
    t = open_transport(spec, **kwargs)
    try:
        t.register(layout, spec.memory_kind, 0)
        for p in peers:
            t.connect(p.name, p.metadata)
            assert p.call("connect", t.name, t.local_metadata()) == "ok"
    except BaseException:
        t.close()
        raise
    return Local(t, storage, layout, list(peers))
