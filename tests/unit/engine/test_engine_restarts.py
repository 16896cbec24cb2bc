"""Restarts and other peers' messages, over the memory transport with a fake clock: a P restarted at
the same address serves push loads again (D hand-shakes anew on the push answer's epoch), a D
restarted under its engine id gets nothing written for its previous process and is counted at its
new TP size, a push notice never completes a read, and every push request for a cancelled transfer
id fails at once. Each failed (a wait to every deadline, a write into another process's blocks, a
load counted mid-read) before."""

from __future__ import annotations

import numpy as np

from kv_connectors import wire
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from tests.unit.engine.engine_harness import CLAIM_ONLY, D2_PORT, D_PORT, P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
ANY_P = ProducerAddress("", "127.0.0.1", P_PORT)  # transfer-id flow: P's engine id not named
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)


def _restart_p(c: Cluster) -> None:
    c.p.engine.close()
    c.p.transport.close()
    c.p = c._node("P", "kv_producer", P_PORT, {"lease_s": 5, "transfer_timeout_s": 10}, fill=1.0)


def _push_load(c: Cluster, rid: str, key: str) -> None:
    c.d.step(StepMetadata(reqs_to_recv={rid: RecvSpec(ANY_P, key, D_BLOCKS, ())}))
    c.p.step(StepMetadata(reqs_to_send={f"p-{rid}": SendSpec(P_BLOCKS, key)}))
    c.run(20, dt=0.05)  # 1 s


def test_push_after_a_producer_restart_is_served_or_fails_fast():
    c = Cluster(d_extra={"mode": "push"})
    _push_load(c, "d0", "x0")
    assert c.d.finished_recving == {"d0"} and not c.d.failed_recving  # warm: D cached P's handshake
    _restart_p(c)
    _push_load(c, "d1", "x1")
    # D's cached handshake is of the dead process, which the new P never connected to: the push
    # answer's epoch tells D, which fails this load at once and hand-shakes again for the next.
    assert "d1" in c.d.failed_recving, "D still waiting 1 s after P (restarted) got its push request"
    _push_load(c, "d2", "x2")
    assert "d2" in c.d.finished_recving and "d2" not in c.d.failed_recving, "D never hand-shook with the new P"


def test_a_push_request_of_a_previous_decode_process_is_not_written_into_the_new_one():
    c = Cluster()
    c.d.step(StepMetadata(reqs_to_recv={"old": RecvSpec(ANY_P, "t1", D_BLOCKS, ())}))
    c.run(2)  # P queued the push request; its prefill has not finished
    c.d.engine.close()
    c.d.transport.close()
    c.d = c._node("D", "kv_consumer", D_PORT, {"handshake_timeout_s": 2, "transfer_timeout_s": 10}, fill=-1.0)
    c.d.step(StepMetadata(reqs_to_recv={"x": RecvSpec(ANY_P, "other", (), (), report=False)}))  # any contact: hand-shakes
    c.run(2)
    before = c.d.kv[:, list(D_BLOCKS), :].copy()  # the new process's blocks (in use by its own requests)
    c.p.step(StepMetadata(reqs_to_send={"p1": SendSpec((1, 2, 3), "t1")}))
    c.run(3)
    assert np.array_equal(c.d.kv[:, list(D_BLOCKS), :], before), "P wrote a dead D process's request into the new one's blocks"


def _recv_tp1(d, rid, remote_rid):
    d.step(StepMetadata(reqs_to_recv={rid: RecvSpec(PEER, remote_rid, D_BLOCKS, P_BLOCKS, remote_tp_size=1)}))


def _run(c, nodes, steps=8):
    for _ in range(steps):
        c.clock.advance(0.001)
        for n in nodes:
            n.step()


def test_a_restarted_decode_at_another_tp_size_frees_ps_blocks_once_read():
    c = Cluster(d_tp=2, heads=2)
    d1 = c.add_rank("kv_consumer", 1, 2, fill=-1.0)
    c.prefill_done("r1", P_BLOCKS)
    for d in (c.d, d1):
        _recv_tp1(d, "d1", "r1")
    _run(c, [c.d, d1, c.p])
    assert c.p.finished_sending == {"r1"}  # warm: P counted 2 readers for engine "D"
    for d in (c.d, d1):  # D restarts at TP 1 under the same engine id (configured engine_id)
        d.engine.close()
        d.transport.close()
    c.d = c._node("D", "kv_consumer", D_PORT, {"handshake_timeout_s": 2, "transfer_timeout_s": 10}, fill=-1.0, tp_size=1)
    c.prefill_done("r2", P_BLOCKS)
    _recv_tp1(c.d, "d2", "r2")
    _run(c, [c.d, c.p])
    assert c.d.finished_recving == {"d2"} and not c.d.failed_recving
    assert "r2" in c.p.finished_sending, "P still waits for a second reader (freed only at lease expiry)"


def test_every_push_request_for_a_cancelled_transfer_fails_at_once():
    c = Cluster()
    d2 = c.add_consumer("D2", D2_PORT)
    c.p.step(StepMetadata(transfers_cancelled={"t1": "prefill request p1 ended with status ABORTED"}))
    for d, rid in ((c.d, "a"), (d2, "b")):  # two D requests under t1 (a router's retry, or D's TP ranks)
        d.step(StepMetadata(reqs_to_recv={rid: RecvSpec(ANY_P, "t1", D_BLOCKS, ())}))
    c.run(20, dt=0.05, nodes=(c.d, d2, c.p))  # 1 s
    assert c.d.failed_recving == {"a"}  # the first is told at once
    assert d2.failed_recving == {"b"}, "the second push request waits out P's push deadline (9 s here, ~29 s by default)"


def test_a_push_notice_does_not_complete_a_read():
    """A TransferDone naming one of D's pulls (from a confused or hostile peer) is ignored: only the
    read's own completion, under the fence, counts it."""
    c = Cluster(d_extra=CLAIM_ONLY, d_delay_s=5.0)  # D's reads take 5 s
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    c.p.transport.send_notif("D-rank0", wire.encode(wire.TransferDone("d1", "P"), c.p.engine.parts.hash))
    c.run(1)
    assert "d1" not in c.d.finished_recving, "D counted its load with the read still in flight"
    c.clock.advance(5.0)
    c.run(3)
    assert "d1" in c.d.finished_recving and "d1" not in c.d.failed_recving
    assert all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))


STAGED = {"staging": "on", "staging_pool_kib": 2, "staging_chunk_kib": 1}


def _staged_loaded(c: Cluster) -> bool:
    return all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))


def test_staged_loads_recover_once_a_transient_disconnect_is_over():
    """One PeerDisconnectedError (a cut link) marked P gone for good at the staging layer: D hand-shook
    again with the same P process, but every later load failed."""
    c = Cluster(p_extra=STAGED, d_extra=STAGED)
    c.prefill_done("r0", P_BLOCKS)
    Cluster.recv(c.d, "d0", "r0", D_BLOCKS, P_BLOCKS)
    c.run(30)
    assert c.d.finished_recving == {"d0"} and not c.d.failed_recving
    c.fabric.dead.add("P-rank0")  # the link to P drops for a moment
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(30)
    assert "d1" in c.d.failed_recving
    c.fabric.dead.discard("P-rank0")  # back: same P process, same metadata
    c.d.kv[:] = -1.0
    for i in range(2, 5):
        c.prefill_done(f"r{i}", P_BLOCKS)
        Cluster.recv(c.d, f"d{i}", f"r{i}", D_BLOCKS, P_BLOCKS)
        c.run(30)
    assert not ({"d2", "d3", "d4"} & c.d.failed_recving), f"loads after the link came back failed: {sorted(c.d.failed_recving)}"
    assert _staged_loaded(c)


def _restart_d(c: Cluster, engine_id: str) -> None:
    c.d.engine.close()
    c.d.transport.close()
    c.d = c._node(engine_id, "kv_consumer", D_PORT, {"handshake_timeout_s": 2, "transfer_timeout_s": 10}, fill=-1.0)


def test_p_keeps_one_consumer_entry_for_a_decode_that_restarted_twenty_times():
    """Each D restart comes with a new engine id (vLLM's default) at the same side-channel address:
    P replaces the old consumer (its layout, metadata, transport connection) instead of keeping one
    per process it ever served."""
    c = Cluster(d_extra={"mode": "push"})
    for i in range(20):
        _restart_d(c, f"D{i}")
        c.prefill_done(f"r{i}", P_BLOCKS)
        c.d.step(StepMetadata(reqs_to_recv={f"d{i}": RecvSpec(PEER, f"r{i}", D_BLOCKS, P_BLOCKS)}))
        c.run(6)
        assert c.d.finished_recving == {f"d{i}"} and not c.d.failed_recving
    sender = c.p.engine.parts.sender
    assert (len(sender.consumers.layouts), len(sender.consumers._metadata), len(sender.consumers.readers)) == (1, 1, 0)
    assert c.p.transport._peers == {"D19-rank0"}, "P's transport keeps a connection per D process"


def test_d_keeps_one_producer_entry_for_a_prefill_that_restarted_twenty_times():
    c = Cluster()
    for i in range(20):
        c.p.engine.close()
        c.p.transport.close()
        c.p = c._node(f"P{i}", "kv_producer", P_PORT, {"lease_s": 5, "transfer_timeout_s": 10}, fill=1.0)
        c.prefill_done(f"r{i}", P_BLOCKS)
        c.d.step(
            StepMetadata(
                reqs_to_recv={f"d{i}": RecvSpec(ProducerAddress(f"P{i}", "127.0.0.1", P_PORT), f"r{i}", D_BLOCKS, P_BLOCKS)}
            )
        )
        c.run(6)
        assert f"d{i}" in c.d.finished_recving and not c.d.failed_recving
    assert len(c.d.engine.parts.receiver.producers._peers) == 1
    assert c.d.transport._peers == {"P19-rank0"}, "D's transport keeps a connection per P process"
