"""Test-side helpers shared by the transport tests: peer processes, the local transport, waits and block choices."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kv_connectors.errors import TransportError
from kv_connectors.layout import KVLayout
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import XferState
from tests.transports.peer import STAGED_BLOCKS, PeerSpec, layout_of, make_kv, open_transport, serve

_CTX = mp.get_context("spawn")
STARTUP_S = 60.0  # a spawned peer imports numpy, torch and an engine: slow on a loaded 2-core machine
STOP_S = 5.0


# Peer processes ------------------------------------------------------------------------------
@dataclasses.dataclass
class Peer:
    """A peer process (peer.serve) and its pipe; wait_s is the default deadline of its waits."""

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

    def wait_notif(self, sender: str, msg: bytes, timeout: float | None = None) -> str:
        """Wait for one notification; returns the peer's storage digest taken when it arrived."""
        timeout = self.wait_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.inbox += self.call("notifs")
            for item in self.inbox:
                if item[:2] == (sender, msg):
                    self.inbox.remove(item)
                    return item[2]
            time.sleep(0.01)
        raise AssertionError(f"peer {self.name} did not get notif {(sender, msg)} (got {self.inbox})")

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

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(self.wait_s)
        assert not self.proc.is_alive()


def start_peers(specs: Sequence[PeerSpec], wait_s: float) -> list[Peer]:
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
            if not p.conn.poll(STARTUP_S):
                raise TimeoutError(f"peer {p.name} did not start within {STARTUP_S} s")
            tag, p.metadata, p.layout = p.conn.recv()
            assert tag == "ready"
    except BaseException:
        stop_peers(peers)
        raise
    return peers


def stop_peers(peers: Sequence[Peer]) -> None:
    for p in peers:
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
    """start(name="p", seed=1, profile="small") -> a ready peer; all are stopped on exit."""
    peers: list[Peer] = []

    def start(name: str = "p", seed: int = 1, profile: str = "small") -> Peer:
        p = start_peers([PeerSpec(kind, name, seed, profile)], wait_s)[0]
        peers.append(p)
        return p

    try:
        yield start
    finally:
        stop_peers(peers)


@contextlib.contextmanager
def loopback_env() -> Iterator[None]:
    """UCX on loopback (spawned peers inherit it); a value already set is kept."""
    old = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = old or "lo"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_NET_DEVICES", None)


# The test process's own transport ------------------------------------------------------------
@dataclasses.dataclass
class Local:
    """The test process's transport over its own patterned KV cache, and the peers connected to it."""

    transport: Any
    storage: list[np.ndarray]
    layout: KVLayout
    peers: list[Peer] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Peers forget us first (staging peers talk back), then our transport closes."""
        for p in self.peers:
            if p.proc.is_alive():
                try:
                    p.call("disconnect", self.transport.name, timeout=STOP_S)
                except (TimeoutError, OSError, EOFError):
                    pass
        self.transport.close()


def open_local(spec: PeerSpec, peers: Sequence[Peer] = ()) -> Local:
    """spec's transport over a fresh KV cache, registered, connected both ways with every peer."""
    storage = make_kv(spec.seed, spec.profile)
    t = open_transport(spec)
    try:
        layout = layout_of(storage)
        t.register(layout)
        for p in peers:
            t.connect(p.name, p.metadata)
            assert p.call("connect", t.name, t.local_metadata()) == "ok"
    except BaseException:
        t.close()
        raise
    return Local(t, storage, layout, list(peers))


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
