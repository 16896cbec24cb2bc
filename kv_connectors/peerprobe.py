"""The doctor's probes: between two processes of this host, and between two hosts (`doctor --serve` on one,
`doctor --peer HOST:PORT` on the other).

Here (`probe_local`): one spawned peer process serves every path in turn (NIXL, Mooncake, each direct and
through CPU staging), so the probes pay one process start. Between hosts: the serving side registers a
patterned host buffer with a NIXL transport and listens on a TCP port; a probing side connects, the two
swap NIXL metadata over that socket (length-prefixed msgpack frames, at most _MAX_FRAME bytes, decoded
into typed records), and the probing side times READs (bytes verified) and WRITEs of scattered 16 KiB
blocks into the served buffer. `doctor` runs the probing side in a child process with UCX_PROTO_INFO=y,
so UCX's own protocol tables say which transport and device carried the bytes to that host
(kv_connectors/doctor.py: ask_peer). The server serves one prober at a time, each for at most _CLIENT_S,
and stops after the time it was given; the served buffer is the only memory a prober can reach.
Each probe alternates READ and WRITE in rounds, so a noisy host slows both alike.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from kv_connectors.config import ConnectorConfig, Role
from kv_connectors.errors import KVConnectorError
from kv_connectors.layout import KVLayout, Region
from kv_connectors.plan import plan_transfer
from kv_connectors.transports import create_transport, ucx_on_loopback
from kv_connectors.transports.base import Transport, XferState
from kv_connectors.transports.memory import host_layout

DEFAULT_PORT = 5799
BLOCK_BYTES = 16 * 1024
SERVE_BYTES = 32 << 20
_MAX_FRAME = 1 << 20  # NIXL metadata is a few KiB
_LEN = struct.Struct("!I")
_CLIENT_S = 60.0  # one prober's session at most
_IO_S = 10.0  # a frame arrives within this
_XFER_S = 20.0  # a probe transfer finishes within this
SERVING = "doctor: serving"  # the line `doctor --serve` prints once it listens
LOCAL_BYTES = {"nixl": 32 << 20, "mooncake": 8 << 20}  # a direct path's buffer on each side
STAGED_BYTES = 4 << 20  # a staged path's (staging is slow on CPU hosts: a few transfers suffice)
_STAGING_POOL = 8 << 20
_STAGING_CHUNK = 1 << 20
ROUNDS = 3  # READ then WRITE, this many times: the medians are reported, every round kept
_START_S = 60.0  # the local peer process starts within this


class Hello(msgspec.Struct, frozen=True, tag=True):
    """Prober -> server: who it is and its NIXL metadata."""

    name: str
    metadata: bytes


class Welcome(msgspec.Struct, frozen=True, tag=True):
    """Server -> prober: its NIXL metadata and where the served buffer is."""

    name: str
    metadata: bytes
    base: int
    nbytes: int
    block_bytes: int


class Refused(msgspec.Struct, frozen=True, tag=True):
    """Server -> prober: why it cannot serve this prober (e.g. its NIXL metadata cannot be loaded)."""

    reason: str


def parse_peer(spec: str) -> tuple[str, int | None]:
    """ "HOST" -> (HOST, None); "HOST:PORT" or "[V6]:PORT" -> (HOST, PORT) for a `doctor --serve` there."""
    colon = True
    if spec.startswith("["):
        host, sep, rest = spec[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"peer {spec!r}: expected [ADDRESS] or [ADDRESS]:PORT")
        colon, port = bool(rest), rest[1:]
    elif spec.count(":") == 1:
        host, port = spec.split(":")
    else:
        colon, host, port = False, spec, ""  # a host name, an IPv4 address or a bare IPv6 address
    if not host:
        raise ValueError(f"peer {spec!r}: no host")
    if not colon:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer {spec!r}: port {port!r} is not 1-65535")
    return host, int(port)


def _send(sock: socket.socket, record: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(record)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVConnectorError(f"the peer sent no complete frame within {_IO_S:g} s")
        sock.settimeout(left)
        try:
            part = sock.recv(n - len(out))
        except TimeoutError as e:
            raise KVConnectorError(f"the peer sent no complete frame within {_IO_S:g} s") from e
        if not part:
            raise KVConnectorError("the peer closed the connection")
        out += part
    return bytes(out)


def _recv(sock: socket.socket, kind: Any) -> Any:
    deadline = time.monotonic() + _IO_S
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > _MAX_FRAME:
        raise KVConnectorError(f"the peer announced a {n}-byte frame (at most {_MAX_FRAME})")
    try:
        return msgspec.msgpack.decode(_recv_exact(sock, n, deadline), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise KVConnectorError(f"the peer's frame is malformed: {e}") from e


def _open(name: str, buf: np.ndarray) -> Transport:
    t = create_transport("nixl", name, ConnectorConfig(engine_id=name, role=Role.BOTH))
    t.register(host_layout(buf, buf.nbytes // BLOCK_BYTES, 16, num_regions=1))
    return t


def pattern(num_blocks: int) -> np.ndarray:
    """Block b holds (b % 251) + 1 in every byte: a copy is checked by one byte per block."""
    return np.repeat((np.arange(num_blocks) % 251 + 1).astype(np.uint8), BLOCK_BYTES)


# The serving side ------------------------------------------------------------------------------
def serve(host: str, port: int, seconds: float, log: Any = print) -> int:
    """Serve probers on host:port for `seconds`; the number of sessions that ended cleanly."""
    buf = pattern(SERVE_BYTES // BLOCK_BYTES)
    t = _open(f"doctor-serve-{socket.gethostname()}", buf)
    served = 0
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, port), family=family) as listener:
            log(f"{SERVING} {host}:{listener.getsockname()[1]} for {seconds:g} s", flush=True)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                ready, _, _ = select.select([listener], [], [], min(1.0, max(0.0, end - time.monotonic())))
                if not ready:
                    continue
                try:
                    conn, addr = listener.accept()
                except OSError as e:
                    log(f"doctor: accept failed: {e}", flush=True)
                    continue
                with conn:
                    try:
                        _session(conn, t, buf)
                        served += 1
                    except (KVConnectorError, OSError) as e:
                        log(f"doctor: a probe from {addr[0]} failed: {e}", flush=True)
                    finally:
                        buf[:] = pattern(buf.nbytes // BLOCK_BYTES)  # whatever a prober wrote, the next reads the pattern
    finally:
        t.close()
    return served


def _session(conn: socket.socket, t: Transport, buf: np.ndarray) -> None:
    hello = _recv(conn, Hello)
    name = hello.name[:128]  # the prober's NIXL agent name (its metadata must say the same)
    try:
        t.connect(name, hello.metadata)
    except KVConnectorError as e:
        _send(conn, Refused(f"the server cannot connect to this prober's NIXL agent: {e}"[:4096]))
        raise
    try:
        _send(conn, Welcome(t.name, t.local_metadata(), int(buf.ctypes.data), buf.nbytes, BLOCK_BYTES))
        end = time.monotonic() + _CLIENT_S
        conn.setblocking(False)
        while time.monotonic() < end:  # progress the transport until the prober hangs up
            t.get_notifs()
            with contextlib.suppress(BlockingIOError):
                if conn.recv(64) == b"":
                    return
            time.sleep(0.0005)
        raise KVConnectorError(f"the prober did not finish within {_CLIENT_S:g} s")
    finally:
        t.disconnect(name)


# The probing side ------------------------------------------------------------------------------
def _wait(t: Transport, handle: Any) -> None:
    deadline = time.monotonic() + _XFER_S
    while t.poll(handle) is not XferState.DONE:
        if time.monotonic() > deadline:
            t.release(handle)
            raise KVConnectorError(f"a probe transfer did not finish within {_XFER_S:g} s")
    t.release(handle)


def timed_ops(
    t: Transport,
    peer: str,
    peer_layout: KVLayout,
    local_layout: KVLayout,
    buf: np.ndarray,
    seconds: float,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    """GB/s of READ (bytes verified against pattern()) and WRITE of every block in shuffled order, in
    `rounds` alternating rounds of at least `seconds / rounds` each (and one transfer), after one
    unmeasured transfer each way: the medians as read_gbps / write_gbps, each round in read_rounds /
    write_rounds."""
    num_blocks = local_layout.num_blocks
    rng = np.random.default_rng(0)
    src = rng.permutation(num_blocks).tolist()
    dst = rng.permutation(num_blocks).tolist()
    plans = {
        "read": plan_transfer(peer_layout, src, local_layout, dst),
        "write": plan_transfer(local_layout, dst, peer_layout, src),
    }
    measured: dict[str, list[float]] = {"read": [], "write": []}
    for op, plan in plans.items():  # unmeasured: the first transfer each way also sets up the connection
        _wait(t, t.post_read(peer, plan, b"") if op == "read" else t.post_write(peer, plan, b""))
    for _ in range(max(1, rounds)):
        for op, plan in plans.items():
            moved, started = 0, time.monotonic()
            while moved == 0 or time.monotonic() - started < seconds / max(1, rounds):
                _wait(t, t.post_read(peer, plan, b"") if op == "read" else t.post_write(peer, plan, b""))
                moved += plan.total_bytes
            measured[op].append(round(moved / (time.monotonic() - started) / 1e9, 3))
            if op == "read":
                got = buf.reshape(num_blocks, BLOCK_BYTES)[dst, 0]
                if not np.array_equal(got, (np.asarray(src) % 251 + 1).astype(np.uint8)):
                    raise KVConnectorError("the probe's READ moved the wrong bytes")
    out: dict[str, Any] = {}
    for op, values in measured.items():
        out[f"{op}_gbps"] = float(np.median(values))
        out[f"{op}_rounds"] = values
    out["descriptors"] = plans["read"].num_runs
    return out


def probe_remote(host: str, port: int, seconds: float = 0.4) -> dict[str, Any]:
    """READ and WRITE GB/s against the `doctor --serve` at host:port, or {"error": why}."""
    t: Transport | None = None
    try:
        with socket.create_connection((host, port), timeout=_IO_S) as sock:
            buf = np.zeros(SERVE_BYTES, np.uint8)
            t = _open(f"doctor-probe-{socket.gethostname()}-{os.getpid()}", buf)
            _send(sock, Hello(t.name, t.local_metadata()))
            welcome = _recv(sock, Welcome | Refused)
            if isinstance(welcome, Refused):
                raise KVConnectorError(f"the doctor --serve at {host}:{port} refused: {welcome.reason}")
            if welcome.block_bytes != BLOCK_BYTES or not 0 < welcome.nbytes <= SERVE_BYTES or welcome.nbytes % BLOCK_BYTES:
                raise KVConnectorError(f"the server offers {welcome.nbytes} bytes in {welcome.block_bytes}-byte blocks")
            num_blocks = welcome.nbytes // BLOCK_BYTES
            t.connect(welcome.name, welcome.metadata)
            remote = KVLayout(num_blocks, 16, (Region(welcome.base, BLOCK_BYTES, BLOCK_BYTES, num_blocks),))
            local = host_layout(buf[: welcome.nbytes], num_blocks, 16, num_regions=1)
            return timed_ops(t, welcome.name, remote, local, buf[: welcome.nbytes], seconds)
    except OSError as e:
        return {"error": f"cannot reach a `doctor --serve` at {host}:{port}: {e}"}
    except KVConnectorError as e:
        return {"error": str(e)}
    finally:
        if t is not None:
            t.close()


# Two processes of this host --------------------------------------------------------------------
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
