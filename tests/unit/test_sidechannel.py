"""Side channel over real zmq sockets on 127.0.0.1: replies, deadlines, port in use, incompatible peers."""

import socket
import time

import msgspec
import pytest

from kv_connectors import sidechannel, wire
from kv_connectors.errors import HandshakeError, IncompatiblePeerError, SideChannelBindError
from tests.unit.test_wire_config import COMPAT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _handler(body):
    if isinstance(body, wire.StatsRequest):
        return wire.StatsReply("p", 1, 7, 0, 0)
    if isinstance(body, wire.HandshakeRequest) and body.compat.hash() != COMPAT.hash():
        return wire.ErrorReply("incompatible", COMPAT.diff(body.compat))
    if isinstance(body, wire.HandshakeRequest):
        return wire.HandshakeReply("p", "agent-p", b"meta", wire.LayoutMsg(4, 32, []))
    raise RuntimeError("boom")


@pytest.fixture
def server():
    port = _free_port()
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
        sidechannel.request("127.0.0.1", _free_port(), wire.StatsRequest(), "", 0.5)
    assert time.monotonic() - t0 < 3
