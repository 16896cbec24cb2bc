"""The doctor's probe between two hosts: `doctor --serve` on one, `doctor --peer HOST:PORT` on the other.

The serving side registers a patterned host buffer with a NIXL transport and listens on a TCP port; a
probing side connects, the two swap NIXL metadata over that socket (length-prefixed msgpack frames, at
most _MAX_FRAME bytes, decoded into typed records), and the probing side times READs (bytes verified)
and WRITEs of scattered 16 KiB blocks into the served buffer (timing.py). `doctor` runs the probing
side in a child process with UCX_PROTO_INFO=y, so UCX's own protocol tables say which transport and
device carried the bytes to that host (ucxinfo.py: ask_peer). The server serves one prober at a time,
each for at most _CLIENT_S, and stops after the time it was given; the served buffer is the only memory
a prober can reach. Each probe alternates READ and WRITE in rounds, so a noisy host slows both alike.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time
from typing import Any

import msgspec
import numpy as np

from kv_connectors.config import ConnectorConfig, Role
from kv_connectors.doctor.timing import BLOCK_BYTES, pattern, timed_ops
from kv_connectors.errors import KVConnectorError
from kv_connectors.layout import KVLayout, Region
from kv_connectors.transports import create_transport
from kv_connectors.transports.base import Transport
from kv_connectors.transports.memory import host_layout

DEFAULT_PORT = 5799
SERVE_BYTES = 32 << 20
_MAX_FRAME = 1 << 20  # NIXL metadata is a few KiB
_LEN = struct.Struct("!I")
_CLIENT_S = 60.0  # one prober's session at most
_IO_S = 10.0  # a frame arrives within this
SERVING = "doctor: serving"  # the line `doctor --serve` prints once it listens


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
