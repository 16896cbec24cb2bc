"""The doctor's probes between two processes of this host: one spawned peer serves every path in turn
(NIXL, Mooncake, each direct and through CPU staging), so the probes pay one process start."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kv_connectors.config import ConnectorConfig, Role
from kv_connectors.doctor.timing import BLOCK_BYTES, ROUNDS, pattern, timed_ops
from kv_connectors.errors import KVConnectorError
from kv_connectors.layout import KVLayout, Region
from kv_connectors.transports import create_transport, ucx_on_loopback
from kv_connectors.transports.base import Transport
from kv_connectors.transports.memory import host_layout

LOCAL_BYTES = {"nixl": 32 << 20, "mooncake": 8 << 20}  # a direct path's buffer on each side
STAGED_BYTES = 4 << 20  # a staged path's (staging is slow on CPU hosts: a few transfers suffice)
_STAGING_POOL = 8 << 20
_STAGING_CHUNK = 1 << 20
_START_S = 60.0  # the local peer process starts within this


def _open_path(kind: str, name: str, staged: bool, buf: np.ndarray) -> Transport:
    inner = create_transport(kind, name, ConnectorConfig(engine_id=name, role=Role.BOTH, mooncake_protocol="tcp"))
    transport: Transport = inner
    if staged:
        from kv_connectors.transports.staging import StagedTransport

        transport = StagedTransport(inner, pool_bytes=_STAGING_POOL, chunk_bytes=_STAGING_CHUNK)
    transport.register(host_layout(buf, buf.nbytes // BLOCK_BYTES, 16, num_regions=1))
    return transport


def _path_bytes(kind: str, staged: bool) -> int:
    return STAGED_BYTES if staged else LOCAL_BYTES.get(kind, STAGED_BYTES)


def _local_peer(conn: Connection, nbytes: int | None) -> None:
    """The other process: for each ("open", kind, staged) a transport over a patterned buffer, its
    metadata sent back; then it connects to the prober and keeps its transport progressing (staging
    needs it) until ("close",); ("stop",) ends it. Errors are sent back, one path at a time."""
    t: Transport | None = None
    staged = False
    while True:
        if not conn.poll(0.0005):
            if t is not None and staged:
                t.get_notifs()
            continue
        cmd = conn.recv()
        try:
            if cmd[0] == "stop":
                break
            if cmd[0] == "open":
                _, kind, staged, name = cmd
                buf = pattern((nbytes or _path_bytes(kind, staged)) // BLOCK_BYTES)  # kept alive while t is open
                t = _open_path(kind, name, staged, buf)
                conn.send(("ready", t.local_metadata(), int(buf.ctypes.data)))
            elif cmd[0] == "connect" and t is not None:
                t.connect(cmd[1], cmd[2])
                conn.send(("ok",))
            elif cmd[0] == "close":
                if t is not None:
                    t.close()
                t = None
                conn.send(("closed",))
        except BaseException as e:  # reported to the prober, which reports the path as failed
            with contextlib.suppress(OSError):
                conn.send(("error", f"{type(e).__name__}: {e}"))
            t = None
    if t is not None:
        t.close()


def _answer(conn: Connection, timeout: float, what: str) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise KVConnectorError(f"the probe's peer process did not answer {what} within {timeout:g} s")
    answer: tuple[Any, ...] = conn.recv()
    if answer[0] == "error":
        raise KVConnectorError(answer[1])
    return answer


def _probe_path(conn: Connection, kind: str, staged: bool, nbytes: int | None, seconds: float, rounds: int) -> dict[str, Any]:
    """One path: both sides open their transport at once (each engine's import and start-up costs
    seconds), connect both ways, time the operations, and close at once."""
    suffix = f"{kind}{'-staged' if staged else ''}"
    conn.send(("open", kind, staged, f"doctor-peer-{suffix}"))
    size = nbytes or _path_bytes(kind, staged)
    num_blocks = size // BLOCK_BYTES
    buf = np.zeros(size, np.uint8)
    t = _open_path(kind, f"doctor-self-{suffix}", staged, buf)
    try:
        _, peer_metadata, peer_base = _answer(conn, _START_S, "open")
        t.connect(f"doctor-peer-{suffix}", peer_metadata)
        conn.send(("connect", t.name, t.local_metadata()))
        _answer(conn, 30.0, "connect")
        peer_layout = KVLayout(num_blocks, 16, (Region(peer_base, BLOCK_BYTES, BLOCK_BYTES, num_blocks),))
        local_layout = host_layout(buf, num_blocks, 16, num_regions=1)
        return timed_ops(t, f"doctor-peer-{suffix}", peer_layout, local_layout, buf, seconds, rounds)
    finally:
        with contextlib.suppress(OSError):
            conn.send(("close",))
        t.close()
        with contextlib.suppress(KVConnectorError, OSError):
            _answer(conn, 10.0, "close")


ProbePath = tuple[str, bool]  # (transport kind, staged)


def probe_local(
    paths: Sequence[ProbePath],
    seconds: float = 0.3,
    rounds: int = ROUNDS,
    nbytes: int | None = None,
    then: Callable[[dict[str, dict[str, Any]]], Sequence[ProbePath]] | None = None,
) -> dict[str, dict[str, Any]]:
    """READ and WRITE GB/s between this process and one spawned peer for each (kind, staged) path,
    keyed "nixl", "nixl+staged", ...: timed_ops's answer, or {"error": why} for a path that failed.
    `then`, given the results so far, names more paths to probe with the same peer."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_local_peer, args=(theirs, nbytes), daemon=True)
    with ucx_on_loopback():
        proc.start()
    out: dict[str, dict[str, Any]] = {}
    try:
        for batch in (paths, None):
            for kind, staged in batch if batch is not None else (then(out) if then else ()):
                key = kind + ("+staged" if staged else "")
                if not proc.is_alive():
                    out[key] = {"error": f"the probe's peer process exited (status {proc.exitcode})"}
                    continue
                try:
                    out[key] = _probe_path(mine, kind, staged, nbytes, seconds, rounds)
                except KVConnectorError as e:
                    out[key] = {"error": str(e)}
                except Exception as e:  # an engine's own exception: this path failed, the others are still probed
                    out[key] = {"error": f"{type(e).__name__}: {e}"}
        return out
    finally:
        with contextlib.suppress(OSError):
            mine.send(("stop",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
