"""D finding P's ranks through rank 0 (P's ranks > 0 listen on ports the system picks, named by rank
0; core/test_ports.py has the port layouts): a producer's answer checked, asked once, asked again after
a failed load (a restarted P's ranks listen elsewhere), and a rank 0 that never answers fails the load."""

from __future__ import annotations

import numpy as np
import pytest

from kv_connectors import wire
from kv_connectors.consumer.ranks import ProducerRanks
from kv_connectors.errors import KVConnectorError, PeerDisconnectedError
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from kv_connectors.transports.memory import MemoryFabric, MemoryTransport
from tests.unit.engine.engine_harness import P_PORT, Cluster, Node

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)


# a producer's answer ----------------------------------------------------------------------------
def test_a_producer_that_names_no_ranks_is_an_older_one_at_port_plus_rank() -> None:
    older = ProducerRanks.of(wire.StatsReply(engine_id="P", tp_size=2), 0.0)
    assert older.key(PEER, 1) == ("P", "127.0.0.1", P_PORT + 1)
    named = ProducerRanks.of(wire.StatsReply(engine_id="P", tp_size=2, ranks=("127.0.0.1:7001", "[::1]:40007")), 0.0)
    assert named.key(PEER, 0) == PEER and named.key(PEER, 1) == ("P", "::1", 40007)


@pytest.mark.parametrize("ranks", [("127.0.0.1:7001",), ("127.0.0.1:7001", "nowhere")])
def test_a_producer_naming_ranks_wrongly_is_refused(ranks: tuple[str, ...]) -> None:
    with pytest.raises(KVConnectorError):
        ProducerRanks.of(wire.StatsReply(engine_id="P", tp_size=2, ranks=ranks), 0.0)


# D finding P's ranks ----------------------------------------------------------------------------
def _p_tp2_d_tp1() -> tuple[Cluster, list[Node]]:
    """P at TP 2 (rank r's blocks hold (r + 1) * 100 + ...), D at TP 1 reading both; 2 KV heads."""
    c = Cluster(p_tp=2, heads=2)
    p1 = c.add_rank("kv_producer", 1, 2, fill=1.0)
    p1.kv += 100  # in place: the registered memory
    return c, [c.p, p1]


def _load(c: Cluster, ps: list[Node], rid: str, steps: int = 10) -> None:
    for p in ps:
        p.step(StepMetadata(reqs_to_send={rid: SendSpec(P_BLOCKS, rid)}))
    c.d.step(StepMetadata(reqs_to_recv={f"d-{rid}": RecvSpec(PEER, rid, D_BLOCKS, P_BLOCKS, remote_tp_size=2)}))
    for _ in range(steps):
        c.clock.advance(0.001)
        for n in [c.d, *ps]:
            n.step()


def _asks(c: Cluster) -> int:
    return sum(isinstance(body, wire.StatsRequest) for body in c.fabric.requests)


def test_p_rank_1_listens_where_the_system_picked_and_rank_0_names_it() -> None:
    c, ps = _p_tp2_d_tp1()
    assert ps[1].engine.parts.server.port not in (P_PORT, P_PORT + 1)
    assert ps[0].engine.stats.ranks == (ps[0].engine.address, ps[1].engine.address)
    _load(c, ps, "r1")
    assert c.d.recv_reports == ["d-r1"] and not c.d.failed_recving
    half = c.d.kv.shape[2] // 2  # D's block: P rank 0's head, then P rank 1's
    for d_block, p_block in zip(D_BLOCKS, P_BLOCKS):
        assert np.array_equal(c.d.block(d_block)[:, :half], ps[0].block(p_block))
        assert np.array_equal(c.d.block(d_block)[:, half:], ps[1].block(p_block))
    for p in ps:
        assert p.finished_sending == {"r1"}
    _load(c, ps, "r2")
    assert c.d.recv_reports == ["d-r1", "d-r2"] and not c.d.failed_recving
    assert _asks(c) == 1  # asked once, then known


def test_a_restarted_p_rank_elsewhere_costs_at_most_one_load() -> None:
    c, ps = _p_tp2_d_tp1()
    _load(c, ps, "r1")
    assert c.d.recv_reports == ["d-r1"] and not c.d.failed_recving
    ps[1].engine.close()  # P's rank 1 restarts: a new process, on another port
    ps[1] = c.add_rank("kv_producer", 1, 2, fill=1.0)
    assert ps[0].engine.stats.ranks[1] == ps[1].engine.address
    for rid in ("r2", "r3"):
        _load(c, ps, rid, steps=40)
    assert c.d.recv_reports == ["d-r1", "d-r2", "d-r3"]
    assert "d-r3" not in c.d.failed_recving  # the failed load made D ask rank 0 again
    assert _asks(c) == 1 + len(c.d.failed_recving)


def test_a_producer_that_cannot_say_its_ranks_fails_the_load_clearly() -> None:
    c, ps = _p_tp2_d_tp1()
    c.fabric.frozen.add(f"127.0.0.1:{P_PORT}")  # rank 0 never answers
    _load(c, ps, "r1", steps=1)
    c.clock.advance(3)  # past D's 2 s handshake deadline
    for _ in range(3):
        c.d.step()
    assert c.d.failed_recving == {"d-r1"}


def test_the_fake_breaks_links_to_a_process_replaced_under_its_name() -> None:
    """As NIXL after a peer restarted under the same agent name: the old endpoint reports a
    disconnect until the peer is connected anew (the restart test above relies on it)."""
    fabric = MemoryFabric()
    d, old = MemoryTransport("D", fabric), MemoryTransport("P-rank1", fabric)
    d.connect("P-rank1", b"P-rank1")
    assert d._peer("P-rank1") is old
    old.close()
    new = MemoryTransport("P-rank1", fabric)
    with pytest.raises(PeerDisconnectedError):
        d._peer("P-rank1")
    d.connect("P-rank1", b"P-rank1")
    assert d._peer("P-rank1") is new
