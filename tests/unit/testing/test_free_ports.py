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


class _Repeating:
    """A random source that draws the same port again, as two independent draws can."""

    def __init__(self, draws: list[int]) -> None:
        self._draws = iter(draws)

    def randint(self, low: int, high: int) -> int:
        return next(self._draws)


def test_a_port_handed_out_once_is_not_handed_out_again(monkeypatch):
    # Two free_port() calls for two servers of one plan drew the same port (CI: the GPU check's
    # dry run, 'ports used twice'): nothing binds a port between the draw and the child's start.
    import kvc_testing.procs as procs

    base = 11_000  # below the ephemeral range
    monkeypatch.setattr(procs, "_ports", _Repeating([base, base, base, base + 1, base + 1, base + 2]))
    monkeypatch.setattr(procs, "_handed", set())
    assert [procs.free_port(), procs.free_port()] == [base, base + 1]
    assert procs.free_ports(1) == [base + 2]


def test_a_range_avoids_ports_already_handed_out(monkeypatch):
    import kvc_testing.procs as procs

    base = 12_000
    monkeypatch.setattr(procs, "_ports", _Repeating([base, base - 1, base + 10, base + 11, base + 1]))
    monkeypatch.setattr(procs, "_handed", set())
    assert procs.free_port() == base
    assert procs.free_port_range(2) == base + 10  # base - 1 .. base overlaps a port handed out
    assert procs.free_port() == base + 1  # base + 11 lies inside the range handed out


def test_pytest_xdist_workers_draw_from_disjoint_shares(monkeypatch):
    import kvc_testing.procs as procs

    high = _ephemeral_low() - 1
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert procs.port_span() == (procs.LOWEST_PORT, high)
    spans = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        spans.append(procs.port_span())
    assert spans[0][0] == procs.LOWEST_PORT and spans[2][1] <= high
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans  # disjoint, in order
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert all(spans[1][0] <= p <= spans[1][1] for p in procs.free_ports(20))
    first = procs.free_port_range(4)
    assert spans[1][0] <= first and first + 3 <= spans[1][1]
