"""Side channel: a pyzmq server on P answering handshakes and stats, and a client with deadlines."""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from collections.abc import Callable
from typing import Protocol

import zmq

from kv_connectors import wire
from kv_connectors.errors import (
    HandshakeError,
    IncompatiblePeerError,
    KVConnectorError,
    NoAnswerError,
    SideChannelBindError,
    UnauthenticatedPeerError,
)
from kv_connectors.logutil import RateLimitedLog

logger = logging.getLogger(__name__)
_limited = RateLimitedLog(logger)

Handler = Callable[[wire.Body], wire.Body]

_POLL_MS = 100
_LISTEN_PROBE_S = 1.0
DEFAULT_MAX_MSG_BYTES = 16 * 1024 * 1024  # far above any legitimate message (handshakes are KiBs)


def endpoint(host: str, port: int | str) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


def address(host: str, port: int) -> str:
    """A side channel's address as peers are told it ("host:port", "[v6]:port")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_MAX_ADDRESS_CHARS = 300


def parse_address(text: object) -> tuple[str, int]:
    """(host, port) of an address a peer sent (`address`'s form): checked, never trusted."""
    if not isinstance(text, str) or not 0 < len(text) <= _MAX_ADDRESS_CHARS:
        raise KVConnectorError(f"not a side-channel address: {str(text)[:80]!r}")
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c in host for c in "[]/ "):
        raise KVConnectorError(f"not a side-channel address: {text[:80]!r}")
    return host, int(port)


def answer(data: bytes, compat_hash: str, handler: Handler, secret: bytes | None = None) -> bytes:
    """A server's answer to one request frame (whatever it holds: errors become ErrorReply)."""
    try:
        try:
            frame = wire.unseal(data, secret)
        except UnauthenticatedPeerError:
            if not wire.is_stats_request(data):  # monitoring may read counters without the secret
                raise
            frame = data
        # Every request but a handshake (compared field by field by the handler) and stats
        # must carry our compatibility hash: a peer that never hand-shook cannot claim or push.
        body = wire.decode(frame, expected_hash=compat_hash, unchecked=wire.SERVER_UNCHECKED)
        reply = handler(body)
    except UnauthenticatedPeerError as e:
        _limited.warning("auth", "side channel: refused a message: %s", e)
        return wire.encode(wire.ErrorReply(wire.ErrorCode.UNAUTHENTICATED, str(e)), compat_hash)
    except IncompatiblePeerError as e:
        reply = wire.ErrorReply(wire.ErrorCode.INCOMPATIBLE, str(e))
    except KVConnectorError as e:
        reply = wire.ErrorReply(wire.ErrorCode.BAD_REQUEST, str(e))
    except Exception as e:  # a bug must not kill the listener thread (vLLM's built-in hangs then)
        _limited.exception("handler", "side channel handler failed")
        reply = wire.ErrorReply(wire.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
    return wire.seal(wire.encode(reply, compat_hash), secret)


class SideChannelServer:
    """A ROUTER socket on its own thread; each request frame is answered by handler(body).

    Binding happens in the constructor so that a port in use fails start-up at once.
    """

    def __init__(
        self,
        host: str,
        port: int,
        compat_hash: str,
        handler: Handler,
        max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
        secret: bytes | None = None,
    ) -> None:
        self.compat_hash = compat_hash  # may be set later, before the owner answers handshakes
        self._handler = handler
        self._secret = secret or None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A larger frame is dropped by zmq before it is read: it never stalls this one thread.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self.address = endpoint(host, port or "*")  # port 0: one the system picks
        try:
            self._sock.bind(self.address)
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.port = int(self.address.rsplit(":", 1)[1])
        except zmq.ZMQError as e:
            self._sock.close(0)
            self._ctx.term()
            raise SideChannelBindError(
                f"cannot listen on side channel {self.address}: {e.strerror}. Another process "
                "(perhaps a second vLLM instance) uses this port: set a free "
                "kv_connector_extra_config['side_channel_port'] for each instance"
            ) from e
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvc-sidechannel", daemon=True)
        self._thread.start()
        logger.info("side channel listening on %s", self.address)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_POLL_MS):
                    continue
                ident, _empty, frame = self._sock.recv_multipart()
                self._sock.send_multipart([ident, b"", answer(frame, self.compat_hash, self._handler, self._secret)])
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                _limited.exception("socket", "side channel socket error")
            except ValueError:
                _limited.warning("framing", "side channel: dropped a request with unexpected framing")
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000 + 1)
        self._ctx.term()


def request(host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float, secret: bytes | None = None) -> wire.Body:
    """One request/reply with a deadline on a socket of its own; ErrorReply answers become typed errors."""
    sock = _socket()
    try:
        return _exchange(sock, host, port, body, compat_hash, timeout_s, secret, connect=True)
    finally:
        sock.close(0)


def _socket() -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _exchange(
    sock: zmq.Socket[bytes],
    host: str,
    port: int,
    body: wire.Body,
    compat_hash: str,
    timeout_s: float,
    secret: bytes | None,
    connect: bool,
) -> wire.Body:
    address = endpoint(host, port)
    try:
        if connect:
            sock.connect(address)
        sock.send(wire.seal(wire.encode(body, compat_hash), secret))
        if not sock.poll(int(timeout_s * 1000)):
            raise NoAnswerError(f"no answer from side channel {address} within {timeout_s:g} s (peer down?)")
        data = sock.recv()
    except zmq.ZMQError as e:
        raise NoAnswerError(f"side channel {address}: {e.strerror}") from e
    return reply_of(data, body, compat_hash, secret, address)


class Client(Protocol):
    """What the engine needs of a side-channel client (SideChannelClient; the memory fabric's in tests)."""

    def submit(
        self, host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float
    ) -> concurrent.futures.Future[wire.Body]: ...

    def forget(self, host: str, port: int) -> None: ...

    def listening(self, host: str, port: int) -> concurrent.futures.Future[bool]:
        """Whether a process listens at the address (a TCP connect; a stopped process's socket still
        accepts, a dead one's refuses): False says the peer's process is gone."""
        ...

    def close(self) -> None: ...


class _Lane:
    """One peer address's thread and the connection only that thread uses (zmq sockets are not thread-safe)."""

    def __init__(self, port: int) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvc-sc-{port}")
        self.sock: zmq.Socket[bytes] | None = None


class SideChannelClient:
    """Side-channel requests run off the engine thread: one thread per peer address, so that a
    frozen peer delays only its own requests; beyond max_peers addresses the rest share one.
    `forget` ends an address's thread (a producer that failed and that no request names any more)."""

    def __init__(self, max_peers: int = 256, secret: bytes | None = None) -> None:
        self._max_peers = max_peers
        self._secret = secret or None
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._shared = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvc-sidechannel")
        self._probes = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvc-sc-probe")

    def submit(
        self, host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float
    ) -> concurrent.futures.Future[wire.Body]:
        lane = self._lanes.get((host, port))
        if lane is None:
            if len(self._lanes) >= self._max_peers:
                return self._shared.submit(request, host, port, body, compat_hash, timeout_s, self._secret)
            lane = self._lanes[(host, port)] = _Lane(port)
        return lane.executor.submit(self._on_lane, lane, host, port, body, compat_hash, timeout_s)

    def _on_lane(self, lane: _Lane, host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float) -> wire.Body:
        """On the peer's own thread: one connection per peer, kept (a REQ socket per request would cost
        a TCP and a ZMTP handshake each time: the claim of every pull read comes this way)."""
        sock = lane.sock
        fresh = sock is None
        if sock is None:
            sock = lane.sock = _socket()
        try:
            return _exchange(sock, host, port, body, compat_hash, timeout_s, self._secret, connect=fresh)
        except BaseException:
            # A REQ socket without its answer cannot send again (and an answer may still come): a new one.
            lane.sock = None
            sock.close(0)
            raise

    def listening(self, host: str, port: int) -> concurrent.futures.Future[bool]:
        """A TCP connect to the address, on a thread of its own (not behind a frozen peer's requests)."""
        return self._probes.submit(listening, host, port)

    def forget(self, host: str, port: int) -> None:
        """End the address's thread once its request in flight (if any) is over; queued ones are
        cancelled. A later request to it starts a new one."""
        lane = self._lanes.pop((host, port), None)
        if lane is not None:
            lane.executor.shutdown(wait=False, cancel_futures=True)

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.executor.shutdown(wait=False, cancel_futures=True)
        self._shared.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)
        # The peer threads' sockets are theirs to use until they end (a zmq socket is not thread-safe):
        # left to the garbage collector, with LINGER 0.


class WakingClient:
    """A client whose every answer (or failure) calls wake: the engine's idle wait ends with it."""

    def __init__(self, inner: Client, wake: Callable[[], None]) -> None:
        self._inner = inner
        self._wake = wake

    def submit(
        self, host: str, port: int, body: wire.Body, compat_hash: str, timeout_s: float
    ) -> concurrent.futures.Future[wire.Body]:
        future = self._inner.submit(host, port, body, compat_hash, timeout_s)
        future.add_done_callback(lambda _f: self._wake())
        return future

    def forget(self, host: str, port: int) -> None:
        self._inner.forget(host, port)

    def listening(self, host: str, port: int) -> concurrent.futures.Future[bool]:
        future = self._inner.listening(host, port)
        future.add_done_callback(lambda _f: self._wake())
        return future

    def close(self) -> None:
        self._inner.close()


def listening(host: str, port: int, timeout_s: float = _LISTEN_PROBE_S) -> bool:
    """Whether something accepts TCP connections at the address. Refused: no process listens
    there (the peer's process is gone); a stopped process's listening socket still accepts, and a
    host that does not answer in timeout_s counts as listening (not known to be gone)."""
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True


def reply_of(data: bytes, body: wire.Body, compat_hash: str, secret: bytes | None, address: str) -> wire.Body:
    """The answer to `body`, checked; ErrorReply answers become typed errors."""
    reply = _decode_reply(data, body, compat_hash, secret, address)
    if isinstance(reply, wire.ErrorReply):
        if reply.code is wire.ErrorCode.INCOMPATIBLE:
            raise IncompatiblePeerError(f"incompatible peer (server) at {address}: {reply.message}")
        if reply.code is wire.ErrorCode.UNAUTHENTICATED:
            raise UnauthenticatedPeerError(f"peer at {address} refused our message: {reply.message}")
        raise HandshakeError(f"peer at {address} refused: {reply.message}")
    return reply


def _decode_reply(data: bytes, body: wire.Body, compat_hash: str, secret: bytes | None, address: str) -> wire.Body:
    """Decode an answer; a server refusing our authentication answers unsealed, and says why."""
    expected = compat_hash if compat_hash else None
    try:
        return wire.decode(wire.unseal(data, secret), expected_hash=expected)
    except UnauthenticatedPeerError:
        if not data.startswith(wire.MAC_MAGIC):
            refusal = wire.decode(data, expected_hash=None)
            if isinstance(refusal, wire.ErrorReply) and refusal.code is wire.ErrorCode.UNAUTHENTICATED:
                raise UnauthenticatedPeerError(f"peer at {address} refused our message: {refusal.message}") from None
        elif isinstance(body, wire.StatsRequest):  # counters from a server with a secret: monitoring
            return wire.decode(data[len(wire.MAC_MAGIC) + wire.MAC_LEN :], expected_hash=None)
        raise


def query_stats(host: str, port: int, timeout_s: float = 5.0) -> wire.StatsReply:
    """Ask a producer's side channel how many KV blocks it holds for peers (ops and tests)."""
    reply = request(host, port, wire.StatsRequest(), "", timeout_s)
    if not isinstance(reply, wire.StatsReply):
        raise HandshakeError(f"unexpected answer to stats: {type(reply).__name__}")
    return reply
