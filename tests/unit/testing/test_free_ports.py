"""kvc_testing's free ports: distinct, bindable, and outside the kernel's ephemeral range (a port the
kernel can hand to another process's bind(0) or connection before the child binds it once failed a
server start with 'Address already in use')."""

from __future__ import annotations

import socket

from kvc_testing.procs import _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert all(10_000 <= p < _ephemeral_low() for p in ports), ports
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
