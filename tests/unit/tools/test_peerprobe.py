"""The doctor's two-host probe without engines: peer specs, and the frames its server reads from a socket."""

from __future__ import annotations

import socket
import struct

import msgspec
import pytest

from kv_connectors.doctor.peerprobe import _MAX_FRAME, Hello, Welcome, _recv, _send, parse_peer
from kv_connectors.errors import KVConnectorError


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("p-node", ("p-node", None)),
        ("10.0.0.2", ("10.0.0.2", None)),
        ("10.0.0.2:5799", ("10.0.0.2", 5799)),
        ("p-node:1", ("p-node", 1)),
        ("fe80::1", ("fe80::1", None)),
        ("[fe80::1]", ("fe80::1", None)),
        ("[fe80::1]:5799", ("fe80::1", 5799)),
    ],
)
def test_peer_specs(spec, want):
    assert parse_peer(spec) == want


@pytest.mark.parametrize("spec", ["", ":5799", "p:", "p:0", "p:65536", "p:http", "[fe80::1", "[fe80::1]x", "[fe80::1]:"])
def test_bad_peer_specs_are_refused(spec):
    with pytest.raises(ValueError):
        parse_peer(spec)


def test_frames_round_trip_and_bad_ones_are_typed_errors():
    a, b = socket.socketpair()
    with a, b:
        _send(a, Hello("d", b"metadata"))
        assert _recv(b, Hello) == Hello("d", b"metadata")
        _send(a, Welcome("p", b"md", 4096, 1 << 20, 16384))
        assert _recv(b, Welcome).base == 4096
        a.sendall(struct.pack("!I", _MAX_FRAME + 1))  # an announced frame over the limit: refused before reading it
        with pytest.raises(KVConnectorError, match="frame"):
            _recv(b, Hello)
        data = msgspec.msgpack.encode({"name": 7})
        a.sendall(struct.pack("!I", len(data)) + data)
        with pytest.raises(KVConnectorError, match="malformed"):
            _recv(b, Hello)
        a.sendall(struct.pack("!I", 10) + b"abc")
        a.close()
        with pytest.raises(KVConnectorError, match="closed"):
            _recv(b, Hello)
