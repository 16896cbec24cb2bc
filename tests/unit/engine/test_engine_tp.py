"""Tensor parallelism over the memory transport: D rank r reads (or is written by) P rank r only,
heartbeats and releases go to that rank, and a peer of another TP size is refused at the
handshake within its deadline, naming both sides' sizes."""

from __future__ import annotations

import numpy as np
import pytest

from kv_connectors.params import TP_SIZE, parse_remote_prefill, producer_params
from kv_connectors.plan import TokenRange
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from tests.unit.engine.engine_harness import CELL_WORDS, P_PORT, Cluster, Node

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)  # what D's scheduler names: P's rank 0 (its params' port)


def _tp2(mode: str = "pull") -> tuple[Cluster, list[Node], list[Node]]:
    """P and D at TP 2; each rank's KV is recognisable (P rank r holds (r + 1) * 100 + block + 1)."""
    c = Cluster(p_extra={"mode": mode}, d_extra={"mode": mode}, p_tp=2, d_tp=2)
    p1 = c.add_rank("kv_producer", 1, 2, fill=1.0, extra={"mode": mode})
    d1 = c.add_rank("kv_consumer", 1, 2, fill=-1.0, extra={"mode": mode})
    ps, ds = [c.p, p1], [c.d, d1]
    for r, p in enumerate(ps):
        p.kv += (r + 1) * 100
    return c, ps, ds


def _prefill(ps: list[Node], rid: str) -> None:
    for p in ps:  # vLLM hands every rank the same metadata
        p.step(StepMetadata(reqs_to_send={rid: SendSpec(P_BLOCKS, rid)}))


def _recv(ds: list[Node], rid: str, remote_rid: str, remote: tuple[int, ...] = P_BLOCKS, report: bool = True) -> None:
    local = D_BLOCKS if report else ()
    for d in ds:
        d.step(StepMetadata(reqs_to_recv={rid: RecvSpec(PEER, remote_rid, local, remote if report else (), report=report)}))


def _run(c: Cluster, nodes: list[Node], steps: int = 8) -> None:
    for _ in range(steps):
        c.clock.advance(0.001)
        for n in nodes:
            n.step()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_each_decode_rank_loads_its_own_prefill_ranks_heads(mode: str):
    """Pull: D rank r reads P rank r's blocks; push: P rank r writes them into D rank r's."""
    c, ps, ds = _tp2(mode)
    _prefill(ps, "r1")
    _recv(ds, "d1", "r1")
    _run(c, [*ds, *ps])
    for p, d in zip(ps, ds):
        assert d.finished_recving == {"d1"} and not d.failed_recving
        for pb, db in zip(P_BLOCKS, D_BLOCKS):
            assert np.array_equal(d.block(db), p.block(pb))
        assert p.finished_sending == {"r1"} and p.engine.stats.expired_leases == 0
    assert not np.array_equal(ds[0].block(D_BLOCKS[0]), ds[1].block(D_BLOCKS[0]))  # the ranks' heads differ


def test_releases_reach_every_prefill_rank():
    c, ps, ds = _tp2()
    _prefill(ps, "r1")
    _recv(ds, "d1", "r1", report=False)
    _run(c, [*ds, *ps])
    for p in ps:
        assert p.finished_sending == {"r1"} and p.engine.stats.expired_leases == 0


def test_heartbeats_keep_every_prefill_ranks_lease():
    c, ps, ds = _tp2()
    _prefill(ps, "r1")
    for d in ds:
        d.step(StepMetadata(renew_start={"d1": (PEER, "r1", None)}))
    for _ in range(40):  # 8 s of queueing against P's 5 s lease
        c.clock.advance(0.2)
        for n in [*ds, *ps]:
            n.step()
    for p in ps:
        assert p.engine.stats.expired_leases == 0 and not p.finished_sending
    for d in ds:
        d.step(StepMetadata(renew_stop={"d1"}))
    _recv(ds, "d1", "r1")
    _run(c, [*ds, *ps])
    for p, d in zip(ps, ds):
        assert d.finished_recving == {"d1"} and not d.failed_recving
        assert np.array_equal(d.block(D_BLOCKS[0]), p.block(P_BLOCKS[0]))


def test_a_decode_instance_of_another_tp_size_is_refused_within_the_handshake_deadline():
    """Blocks whose heads cannot be told apart (no cells), P's TP size not in the params: P's
    handshake refuses the D rank of another TP size."""
    c = Cluster(p_tp=2, d_tp=1)  # D (TP 1) reaches P's rank 0 of 2
    c.prefill_done("r1", P_BLOCKS)
    c.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(steps=3)
    assert c.d.failed_recving == {"d1"}  # at once: no wait for P's lease or the transfer deadline
    assert c.d.engine.stats.recv_failures == 1
    assert np.array_equal(c.d.block(D_BLOCKS[0]), np.full_like(c.d.block(D_BLOCKS[0]), -(D_BLOCKS[0] + 1)))


def test_refusal_names_both_sides_tp_sizes(caplog):
    """Likewise from the other side (D at TP 2, P at 1)."""
    c = Cluster(p_tp=1, d_tp=2)
    c.prefill_done("r1", P_BLOCKS)
    with caplog.at_level("ERROR"):
        c.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
        c.run(steps=3)
    assert c.d.failed_recving == {"d1"}
    text = caplog.text
    assert "tensor_parallel_size 1, decode 2" in text, text  # D asked P's TP size: no params state it


def test_producer_params_carry_the_tp_size_and_decode_reads_it():
    params = producer_params(block_ids=[1], engine_id="P", request_id="r", host="h", port=5, num_tokens=3, tp_size=4)
    assert params[TP_SIZE] == 4 and parse_remote_prefill(params).remote_tp_size == 4
    del params[TP_SIZE]
    assert parse_remote_prefill(params).remote_tp_size is None


# Heterogeneous TP: blocks with cells (2 KV heads, one per rank at TP 2) --------------------------


def _heads(node: Node, block: int, first_head: int) -> dict[int, np.ndarray]:
    """Global head -> that head's words in a block (both regions)."""
    b = node.kv[:, block, :].reshape(2, -1, 4 * CELL_WORDS)
    return {first_head + h: b[:, h].copy() for h in range(b.shape[1])}


def _params_recv(ds: list[Node], rid: str, remote_rid: str, p_tp: int, report: bool = True) -> None:
    spec = RecvSpec(PEER, remote_rid, D_BLOCKS if report else (), P_BLOCKS if report else (), report=report, remote_tp_size=p_tp)
    for d in ds:
        d.step(StepMetadata(reqs_to_recv={rid: spec}))


def _p_tp2(d_extra: dict | None = None, key: str | None = None) -> tuple[Cluster, Node]:
    """P at TP 2 (one head per rank; rank 1's recognisable: +100) and D at TP 1; with key, both P
    ranks hold prefill r1's blocks under it."""
    c = Cluster(p_tp=2, heads=2, d_extra=d_extra)
    p1 = c.add_rank("kv_producer", 1, 2, fill=1.0)
    p1.kv += 100
    if key is not None:
        for p in (c.p, p1):
            p.step(StepMetadata(reqs_to_send={"r1": SendSpec(P_BLOCKS, key)}))
    return c, p1


def _assert_heads_from_both_p_ranks(c: Cluster, p1: Node) -> None:
    """D (TP 1) holds head 0 from P rank 0 and head 1 from P rank 1, reported once; both P ranks freed."""
    assert c.d.recv_reports == ["d1"] and not c.d.failed_recving
    for pb, db in zip(P_BLOCKS, D_BLOCKS):
        got = _heads(c.d, db, 0)
        assert np.array_equal(got[0], _heads(c.p, pb, 0)[0]) and np.array_equal(got[1], _heads(p1, pb, 1)[1])
    assert c.p.finished_sending == {"r1"} and p1.finished_sending == {"r1"}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_tp1_to_decode_tp2_each_decode_rank_loads_its_head_and_p_frees_after_both(mode: str):
    c = Cluster(d_tp=2, heads=2, d_extra={"mode": mode})
    d1 = c.add_rank("kv_consumer", 1, 2, fill=-1.0, extra={"mode": mode})
    c.prefill_done("r1", P_BLOCKS)
    _params_recv([c.d], "d1", "r1", p_tp=1)
    _run(c, [c.d, c.p])
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    assert not c.p.finished_sending, "P freed its blocks while D rank 1 had not loaded its head yet"
    _params_recv([d1], "d1", "r1", p_tp=1)
    _run(c, [d1, c.p])
    assert d1.finished_recving == {"d1"} and c.p.finished_sending == {"r1"}
    for pb, db in zip(P_BLOCKS, D_BLOCKS):
        p_heads = _heads(c.p, pb, 0)
        assert np.array_equal(_heads(c.d, db, 0)[0], p_heads[0])
        assert np.array_equal(_heads(d1, db, 1)[1], p_heads[1])
    assert c.p.engine.stats.expired_leases == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_tp2_to_decode_tp1_loads_each_head_from_its_prefill_rank(mode: str):
    c, p1 = _p_tp2({"mode": mode}, key="r1")
    _params_recv([c.d], "d1", "r1", p_tp=2)
    _run(c, [c.d, c.p, p1])
    _assert_heads_from_both_p_ranks(c, p1)
    assert c.d.engine.stats.recv_transfers == 2  # one load per prefill rank


def test_one_failed_prefill_rank_fails_the_request_once_after_every_read_ended():
    """P rank 0 serves at once; P rank 1 never learns of the request (its claim stays pending until
    D gives up): D reports the request once, failed, when the second read ends."""
    c, p1 = _p_tp2()
    c.prefill_done("r1", P_BLOCKS)
    _params_recv([c.d], "d1", "r1", p_tp=2)
    _run(c, [c.d, c.p, p1])
    assert not c.d.recv_reports, "reported while P rank 1's heads were still on their way"
    assert c.p.finished_sending == {"r1"}, "P rank 0 is not freed once D is done with it"
    c.run(steps=20, dt=0.2, nodes=(c.d, c.p, p1))
    assert c.d.failed_recving == {"d1"} and c.d.recv_reports == ["d1"]


def test_a_prefill_rank_nobody_would_read_is_refused(caplog):
    """2 heads, P at TP 4 (heads replicated over two ranks each), D at TP 1: P ranks 1 and 3 would
    hold their blocks until their leases ran out: refused."""
    c = Cluster(p_tp=4, heads=2)
    with caplog.at_level("ERROR"):
        _params_recv([c.d], "d1", "r1", p_tp=4)
    assert c.d.failed_recving == {"d1"}
    assert "would never be read" in caplog.text


def test_a_release_for_a_split_nobody_can_read_is_not_a_failed_load():
    """vLLM finishes a request whose load was refused (and a copy it never scheduled): the release
    that follows cannot be mapped either; it is dropped (P's lease frees the blocks), never reported
    or counted as a second failed load."""
    c = Cluster(p_tp=4, heads=2)
    _params_recv([c.d], "d1", "r1", p_tp=4)
    _params_recv([c.d], "d1", "r1", p_tp=4, report=False)
    _run(c, [c.d])
    assert c.d.failed_recving == {"d1"} and c.d.recv_reports == ["d1"]
    assert c.d.engine.stats.recv_failures == 1


def test_releases_reach_every_prefill_rank_read_from():
    c, p1 = _p_tp2(key="r1")
    _params_recv([c.d], "d1", "r1", p_tp=2, report=False)
    _run(c, [c.d, c.p, p1])
    assert c.p.finished_sending == {"r1"} and p1.finished_sending == {"r1"}
    assert not c.d.finished_recving


def _transfer_id_recv(ds: list[Node]) -> None:
    """The transfer-id flow: D knows P's side channel and the transfer id, not P's blocks or TP size."""
    spec = RecvSpec(ProducerAddress("", "127.0.0.1", P_PORT), "t1", D_BLOCKS, (), tokens=TokenRange(0, len(D_BLOCKS) * 4))
    for d in ds:
        d.step(StepMetadata(reqs_to_recv={"d1": spec}))


def test_transfer_id_flow_asks_ps_tp_size_then_each_p_rank_writes_its_heads():
    """P at TP 1, D at TP 2: each D rank asks P's rank 0 its TP size (once per P), then P writes
    each D rank its head; P frees the blocks once both are written."""
    c = Cluster(d_tp=2, heads=2)
    d1 = c.add_rank("kv_consumer", 1, 2, fill=-1.0)
    c.p.step(StepMetadata(reqs_to_send={"r1": SendSpec(P_BLOCKS, "t1")}))
    _transfer_id_recv([c.d, d1])
    _run(c, [c.d, d1, c.p])
    for d, head in ((c.d, 0), (d1, 1)):
        assert d.recv_reports == ["d1"] and not d.failed_recving
        for pb, db in zip(P_BLOCKS, D_BLOCKS):
            assert np.array_equal(_heads(d, db, head)[head], _heads(c.p, pb, 0)[head])
    assert c.p.finished_sending == {"r1"} and c.p.engine.stats.pushes == 2


def test_transfer_id_flow_from_a_tp2_prefill_into_a_tp1_decode():
    c, p1 = _p_tp2(key="t1")
    _transfer_id_recv([c.d])
    _run(c, [c.d, c.p, p1])
    _assert_heads_from_both_p_ranks(c, p1)


def test_a_producer_that_does_not_say_its_tp_size_fails_the_load_at_the_handshake_deadline():
    c = Cluster(d_tp=2, heads=2)
    c.fabric.frozen.add(f"127.0.0.1:{P_PORT}")
    _transfer_id_recv([c.d])
    c.run(steps=3)
    assert not c.d.recv_reports
    c.clock.advance(2.5)  # D's handshake deadline is 2 s
    c.run(steps=2, nodes=(c.d,))
    assert c.d.failed_recving == {"d1"}


def test_an_absurd_tp_size_in_the_params_fails_the_request_at_once(caplog):
    """A request naming a TP size no fleet runs (10**6) is refused before anything is sized by it
    (reader counts, P ranks to contact): one such request must not stall or exhaust D."""
    c = Cluster(d_tp=2, heads=2)
    with caplog.at_level("ERROR"):
        _params_recv([c.d], "d1", "r1", p_tp=10**6)
    assert c.d.failed_recving == {"d1"}
    assert "tensor_parallel_size 1000000 is outside 1..4096" in caplog.text


def test_a_handshake_naming_an_absurd_tp_size_is_refused_at_once():
    from kv_connectors import wire

    c = Cluster(heads=2)
    layout = wire.LayoutMsg.from_layout(c.d.engine.parts.layout)
    body = wire.HandshakeRequest("X", 0, c.d.engine.parts.compat, agent_name="x", layout=layout, tp_size=10**6)
    reply = c.p.engine._desk.answer(body)
    assert isinstance(reply, wire.ErrorReply) and "outside 1..4096" in reply.message
