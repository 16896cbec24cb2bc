"""Side channel over real zmq sockets on 127.0.0.1: replies, deadlines, port in use, incompatible peers."""

import socket
import time

import msgspec
import pytest

from kv_connectors import sidechannel, wire
from kv_connectors.errors import HandshakeError, IncompatiblePeerError, SideChannelBindError
from kvc_testing.procs import free_port
from tests.unit.core.wire_samples import COMPAT


def _handler(body):
    if isinstance(body, wire.StatsRequest):
        return wire.StatsReply(engine_id="p", held_requests=1, held_blocks=7)
    if isinstance(body, wire.HandshakeRequest) and body.compat.hash() != COMPAT.hash():
        return wire.ErrorReply("incompatible", COMPAT.diff(body.compat))
    if isinstance(body, wire.HandshakeRequest):
        return wire.HandshakeReply("p", "agent-p", b"meta", wire.LayoutMsg(4, 32, []))
    raise RuntimeError("boom")


@pytest.fixture
def server():
    port = free_port()
    srv = sidechannel.SideChannelServer("127.0.0.1", port, COMPAT.hash(), _handler)
    yield port
    srv.close()


def test_handshake_and_stats(server):
    reply = sidechannel.request("127.0.0.1", server, wire.HandshakeRequest("d", 0, COMPAT), COMPAT.hash(), 5)
    assert isinstance(reply, wire.HandshakeReply) and reply.agent_name == "agent-p"
    stats = sidechannel.query_stats("127.0.0.1", server)
    assert stats.held_blocks == 7


def test_incompatible_peer_gets_a_clear_error(server):
    other = msgspec.structs.replace(COMPAT, num_layers=8)
    with pytest.raises(IncompatiblePeerError, match="num_layers"):
        sidechannel.request("127.0.0.1", server, wire.HandshakeRequest("d", 0, other), other.hash(), 5)


def test_handler_bug_is_an_error_reply_and_the_server_survives(server):
    with pytest.raises(HandshakeError, match="boom"):
        sidechannel.request("127.0.0.1", server, wire.TransferDone("r", "e"), COMPAT.hash(), 5)
    assert sidechannel.query_stats("127.0.0.1", server).held_blocks == 7


def test_port_in_use_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(SideChannelBindError, match=f"{port}.*side_channel_port"):
            sidechannel.SideChannelServer("127.0.0.1", port, "h", _handler)
        assert time.monotonic() - t0 < 2


def test_no_server_times_out():
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="no answer"):
        sidechannel.request("127.0.0.1", free_port(), wire.StatsRequest(), "", 0.5)
    assert time.monotonic() - t0 < 3


def test_oversize_frame_is_dropped_unread_and_the_server_keeps_answering():
    import zmq

    port = free_port()
    srv = sidechannel.SideChannelServer("127.0.0.1", port, COMPAT.hash(), _handler, max_msg_bytes=1 << 20)
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([b"", b"\x00" * (32 << 20)])  # 32 MiB: zmq drops the connection
        t0 = time.monotonic()
        assert sidechannel.query_stats("127.0.0.1", port, timeout_s=5).held_blocks == 7
        assert time.monotonic() - t0 < 5
        assert not sock.poll(200), "the oversize frame was answered"
        sock.close(0)
    finally:
        srv.close()


def test_bind_address_differs_from_the_advertised_one():
    from kv_connectors.config import parse_config

    cfg = parse_config("P", "kv_producer", {"side_channel_host": "10.1.2.3", "side_channel_bind_host": "0.0.0.0"})
    assert (cfg.bind_host, cfg.side_channel_host) == ("0.0.0.0", "10.1.2.3")
    assert parse_config("P", "kv_producer", {"side_channel_host": "h"}).bind_host == "h"
    port = free_port()
    srv = sidechannel.SideChannelServer(cfg.bind_host, port, COMPAT.hash(), _handler)
    try:  # bound on every address: reachable on loopback
        assert sidechannel.query_stats("127.0.0.1", port).held_blocks == 7
    finally:
        srv.close()


def test_client_runs_each_peer_on_its_own_thread():
    """A frozen peer delays only its own requests: another peer's answer does not wait behind it."""
    import threading

    frozen_port = free_port()
    release = threading.Event()

    def frozen(body):
        release.wait(10)
        return _handler(body)

    slow = sidechannel.SideChannelServer("127.0.0.1", frozen_port, COMPAT.hash(), frozen)
    fast_port = free_port()
    fast = sidechannel.SideChannelServer("127.0.0.1", fast_port, COMPAT.hash(), _handler)
    client = sidechannel.SideChannelClient()
    try:
        stuck = [client.submit("127.0.0.1", frozen_port, wire.StatsRequest(), "", 5) for _ in range(3)]
        t0 = time.monotonic()
        assert client.submit("127.0.0.1", fast_port, wire.StatsRequest(), "", 5).result(5).held_blocks == 7
        assert time.monotonic() - t0 < 2
        assert not any(f.done() for f in stuck)
    finally:
        release.set()
        client.close()
        slow.close()
        fast.close()


def test_client_forgets_an_address_and_can_ask_it_again(server):
    """A forgotten address's thread ends (D forgets producers that failed and that no request names);
    a later request to it gets a new one and is answered."""
    client = sidechannel.SideChannelClient()
    try:
        dead = free_port()
        with pytest.raises(HandshakeError):
            client.submit("127.0.0.1", dead, wire.StatsRequest(), "", 0.3).result(5)
        assert client.submit("127.0.0.1", server, wire.StatsRequest(), "", 5).result(5).held_blocks == 7
        assert client.lanes == 2
        client.forget("127.0.0.1", dead)
        client.forget("127.0.0.1", server)
        assert client.lanes == 0
        assert client.submit("127.0.0.1", server, wire.StatsRequest(), "", 5).result(5).held_blocks == 7
    finally:
        client.close()


def test_shared_secret_authenticates_side_channel_messages(monkeypatch):
    from kv_connectors.config import parse_config
    from kv_connectors.errors import ConfigError, UnauthenticatedPeerError

    monkeypatch.setenv("KVC_TEST_SECRET", "s3cret")
    cfg = parse_config("P", "kv_producer", {"side_channel_secret_env": "KVC_TEST_SECRET"})
    assert cfg.side_channel_secret == b"s3cret" and "s3cret" not in repr(cfg)
    with pytest.raises(ConfigError, match="KVC_NO_SUCH_SECRET"):
        parse_config("P", "kv_producer", {"side_channel_secret_env": "KVC_NO_SUCH_SECRET"})
    port = free_port()
    srv = sidechannel.SideChannelServer("127.0.0.1", port, COMPAT.hash(), _handler, secret=b"s3cret")
    try:
        hello = wire.HandshakeRequest("d", 0, COMPAT)
        reply = sidechannel.request("127.0.0.1", port, hello, COMPAT.hash(), 5, secret=b"s3cret")
        assert isinstance(reply, wire.HandshakeReply)
        with pytest.raises(UnauthenticatedPeerError, match="no MAC"):
            sidechannel.request("127.0.0.1", port, hello, COMPAT.hash(), 5)
        with pytest.raises(UnauthenticatedPeerError, match="wrong MAC"):
            sidechannel.request("127.0.0.1", port, hello, COMPAT.hash(), 5, secret=b"other")
        assert sidechannel.query_stats("127.0.0.1", port).held_blocks == 7  # monitoring needs no secret
    finally:
        srv.close()
    plain = sidechannel.SideChannelServer("127.0.0.1", port, COMPAT.hash(), _handler)
    try:  # a client with a secret talking to a server without one gets told so
        with pytest.raises(UnauthenticatedPeerError):
            sidechannel.request("127.0.0.1", port, hello, COMPAT.hash(), 5, secret=b"s3cret")
    finally:
        plain.close()
