"""P's push writes and the blocks they read, over the memory transport with a fake clock: P frees
a lease's blocks only once no write from them is in flight (whatever notice comes first), never
writes into D's blocks after D could have given them up, answers every push request, and frees
every lease it ever added. Each of these served another prompt's KV with no error, or leaked, before."""

from __future__ import annotations

import numpy as np

from kv_connectors.plan import TokenRange
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from tests.unit.engine.engine_harness import P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)
ANY_P = ProducerAddress("", "127.0.0.1", P_PORT)  # the transfer-id flow may not name P's engine
REUSED = 555.0  # what another prompt writes into P's blocks once vLLM reused them


def _recv(node, rid: str, spec: RecvSpec) -> None:
    node.step(StepMetadata(reqs_to_recv={rid: spec}))


def _reuse_if_freed(c: Cluster, rid: str) -> bool:
    """vLLM reuses blocks P reported finished: the next prefill overwrites them."""
    freed = rid in c.p.finished_sending
    if freed:
        for b in P_BLOCKS:
            c.overwrite_p_block(b, REUSED)
    return freed


def _loaded_ok(node, rid: str) -> bool:
    return rid in node.finished_recving and rid not in node.failed_recving


# a notice while a write reads the blocks ---------------------------------------------------------
def test_a_release_does_not_free_blocks_a_push_write_is_reading():
    """Push mode: while P's write for d1 is in flight, a release for the same lease arrives (another
    D request with the same params and prompt, aborted or all prefix hits). The blocks stay until
    the write settles; d1 gets the prompt's KV."""
    c = Cluster(d_extra={"mode": "push"})
    c.p.transport.delay_s = 1.0  # P's writes take 1 s
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS, prompt_digest="A"))
    c.run(4)
    assert c.p.engine.parts.sender.writes._writing, "the write is in flight"
    _recv(c.d, "d2", RecvSpec(PEER, "r1", (), (), report=False, prompt_digest="A"))
    c.run(4)
    assert not _reuse_if_freed(c, "r1"), "P freed blocks its write was still reading"
    c.clock.advance(1.0)
    c.run(4)
    assert _loaded_ok(c.d, "d1") and np.all(c.d.kv[:, list(D_BLOCKS)] != REUSED)
    assert c.p.finished_sending == {"r1"}, "freed once the write settled"


def test_another_readers_notice_does_not_free_blocks_a_push_write_is_reading():
    """One P feeds a pull D and a push D from one lease: the pull reader's notice comes while the
    push write is in flight."""
    c = Cluster(d_extra={"mode": "push"})
    d2 = c.add_consumer()  # pulls
    c.p.transport.delay_s = 1.0
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(4, nodes=(c.d, c.p))
    assert c.p.engine.parts.sender.writes._writing
    _recv(d2, "x", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    d2.transport.delay_s = 0.0
    c.run(6, nodes=(d2, c.p))
    assert _loaded_ok(d2, "x")
    assert not _reuse_if_freed(c, "r1"), "P freed blocks its write was still reading"
    c.clock.advance(1.0)
    c.run(4)
    assert _loaded_ok(c.d, "d1") and np.all(c.d.kv[:, list(D_BLOCKS)] != REUSED)
    assert c.p.finished_sending == {"r1"}


def test_one_decode_ranks_early_notice_waits_for_the_other_ranks_write():
    """P at TP 1, D at TP 2, transfer-id flow, layer-wise push: D rank 0's write settles before P's
    lease is added (its notice comes early); rank 1's is still in flight. The lease must not end
    when it is added: P keeps the blocks until rank 1's write settles."""
    c = Cluster(d_tp=2, heads=2)
    d1 = c.add_rank("kv_consumer", 1, 2, fill=-1.0)
    spec = RecvSpec(ANY_P, "t1", D_BLOCKS, (), tokens=TokenRange(count=len(D_BLOCKS) * 4))
    for d in (c.d, d1):
        d.step(StepMetadata(reqs_to_recv={"d1": spec}))
    c.run(6, nodes=(c.d, d1, c.p))  # both D ranks: TP probe, handshake, push request
    assert len(c.p.engine.parts.sender._waiting) == 2
    c.fabric.frozen.add("D-rank1")  # the write into D rank 1 stays in flight
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "t1")}), layers=("layer.0", "layer.1"))
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "t1")}))  # the prefill finished
    c.p.step()
    assert not _reuse_if_freed(c, "p-req"), "P freed blocks a write into D rank 1 was reading"
    c.fabric.frozen.discard("D-rank1")
    c.run(5, nodes=(c.d, d1, c.p))
    assert _loaded_ok(c.d, "d1") and _loaded_ok(d1, "d1")
    assert c.p.finished_sending == {"p-req"}


# D's deadline ------------------------------------------------------------------------------------
def _late_prefill(p_late_s: float) -> Cluster:
    """Transfer-id flow: D's push request is acknowledged; P's engine is in a long forward pass and
    drains it 0.5 s later; D's deadline passes (D fails the load: vLLM frees or recomputes its
    blocks, which now hold another request's KV), then P's prefill finishes."""
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(3, nodes=(c.d,))
    c.clock.advance(0.5)
    c.p.step()
    c.clock.advance(10.0 - 0.5 + 0.01)  # just past D's 10 s deadline
    c.d.step()
    assert c.d.failed_recving == {"d1"}
    c.d.kv[:, list(D_BLOCKS), :] = 42.0
    c.clock.advance(p_late_s)
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))
    c.run(3, nodes=(c.p, c.d))
    return c


def test_p_does_not_write_into_ds_blocks_after_ds_deadline():
    c = _late_prefill(0.2)  # P had drained the request later than D sent it: its clock ran later
    assert np.all(c.d.kv[:, list(D_BLOCKS), :] == 42.0), "P wrote into blocks D had given up"
    assert c.p.engine.stats.pushes == 0 and c.p.engine.stats.push_failures == 1


def test_p_does_not_write_when_the_lease_comes_in_the_step_after_the_deadline():
    c = _late_prefill(5.0)
    assert np.all(c.d.kv[:, list(D_BLOCKS), :] == 42.0), "P wrote into blocks D had given up"


# two push requests for one lease from one D ------------------------------------------------------
def test_a_second_push_under_the_same_key_and_agent_is_a_second_write():
    """Two D requests with the same P params (a router's duplicate): the first write is still in
    flight when the second comes. Both are tracked and answered; the lease ends after both."""
    c = Cluster(d_extra={"mode": "push"})
    posted: list = []
    post = c.p.transport.post_write
    c.p.transport.post_write = lambda *a, **k: posted.append(post(*a, **k)) or posted[-1]
    c.prefill_done("r1", P_BLOCKS)
    c.p.transport.delay_s = 1.0  # the first write is slow
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(4)
    assert len(posted) == 1
    c.p.transport.delay_s = 0.0  # the second is fast (D had a prefix hit: one block)
    _recv(c.d, "d2", RecvSpec(PEER, "r1", (9,), (3,)))
    c.run(4)
    assert any(posted[0] in w.handles for w in c.p.engine.parts.sender.writes._writing.values()), "first write untracked"
    assert not _reuse_if_freed(c, "r1"), "P freed blocks the first write was still reading"
    c.clock.advance(1.0)
    c.run(4)
    assert _loaded_ok(c.d, "d1") and _loaded_ok(c.d, "d2") and np.all(c.d.kv[:, list(D_BLOCKS)] != REUSED)
    assert c.p.finished_sending == {"r1"}


def test_two_push_requests_waiting_for_one_lease_are_both_answered():
    c = Cluster(d_extra={"mode": "push"})
    _recv(c.d, "d1", RecvSpec(ANY_P, "t1", (5, 6, 7), ()))
    c.run(3)
    _recv(c.d, "d2", RecvSpec(ANY_P, "t1", (9, 10, 11), ()))
    c.run(3)
    c.p.step(StepMetadata(reqs_to_send={"p": SendSpec(P_BLOCKS, "t1")}))
    c.run(3)
    assert {"d1", "d2"} <= c.d.finished_recving and not c.d.failed_recving


# leases that used to leak ------------------------------------------------------------------------
def test_a_lease_replaced_under_the_same_key_is_freed_too():
    """Two prefills under one transfer id (a router's retry of P): both requests' blocks are freed."""
    c = Cluster()
    c.p.step(StepMetadata(reqs_to_send={"p-a": SendSpec(P_BLOCKS, "t1", prompt_digest="A")}))
    c.p.step(StepMetadata(reqs_to_send={"p-b": SendSpec((8, 9, 10), "t1", prompt_digest="A")}))
    c.clock.advance(3600)
    c.run(3, nodes=(c.p,))
    assert c.p.finished_sending == {"p-a", "p-b"}


def test_a_pushed_lease_expires_when_one_decode_rank_never_asks():
    """P at TP 1 pushes to D at TP 2; rank 0 is written, rank 1 never reaches P: the lease expires
    (it used to be held forever once a write had begun)."""
    c = Cluster(d_tp=2, heads=2, d_extra={"mode": "push"})
    c.add_rank("kv_consumer", 1, 2, fill=-1.0, extra={"mode": "push"})  # never gets the request
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS, remote_tp_size=1))
    c.run(6, nodes=(c.d, c.p))
    assert c.d.finished_recving == {"d1"}
    c.clock.advance(3600)
    c.run(3, nodes=(c.p,))
    assert c.p.finished_sending == {"r1"}


def test_a_decode_rank_asking_after_the_other_ranks_early_notice_is_still_served():
    """P at TP 1, D at TP 2, transfer-id flow, layer-wise push: rank 0's push request is here for the
    forward pass, its write settles before P's lease exists (an early notice); rank 1 asks only after
    the prefill finished. The early notice of one rank must not end the lease the other still reads."""
    c = Cluster(d_tp=2, heads=2)
    d1 = c.add_rank("kv_consumer", 1, 2, fill=-1.0)
    spec = RecvSpec(ANY_P, "t1", D_BLOCKS, (), tokens=TokenRange(count=len(D_BLOCKS) * 4))
    c.d.step(StepMetadata(reqs_to_recv={"d1": spec}))
    c.run(6, nodes=(c.d, d1, c.p))
    assert len(c.p.engine.parts.sender._waiting) == 1
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "t1")}), layers=("layer.0", "layer.1"))
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "t1")}))  # the prefill finished
    c.run(3, nodes=(c.d, c.p))
    assert _loaded_ok(c.d, "d1")
    assert not _reuse_if_freed(c, "p-req"), "rank 0's early notice freed the blocks rank 1 has yet to load"
    d1.step(StepMetadata(reqs_to_recv={"d1": spec}))
    c.run(8, nodes=(d1, c.p))
    assert _loaded_ok(d1, "d1"), "rank 1 was refused"
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.expired_leases == 0
