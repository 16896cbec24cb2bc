"""The fence, unit-tested over the memory transport with a fake clock: D counts a read only under
a lease P confirmed live for the whole read; a late, foreign or unclaimed read fails, never
succeeds with another prompt's KV."""

from __future__ import annotations

import numpy as np

from kv_connectors import wire
from kv_connectors.producer.leases import SendLeases
from kv_connectors.specs import ProducerAddress
from kv_connectors.wire import ClaimResult
from tests.unit.engine.engine_harness import CLAIM_ONLY, P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)


def _loaded(c: Cluster, node=None) -> bool:
    node = node or c.d
    return all(np.array_equal(node.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))


def test_read_under_a_live_lease_completes_and_frees_p():
    c = Cluster(d_extra=CLAIM_ONLY)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    assert _loaded(c)
    assert c.p.finished_sending == {"r1"}, "P did not free the blocks on D's notice"
    claims = [m for m in c.fabric.requests if isinstance(m, wire.ClaimRequest)]
    assert len(claims) == 1 and claims[0].items == [wire.ClaimItem("r1", list(P_BLOCKS))]
    s = c.p.engine.stats
    assert (s.completed_sends, s.expired_leases, s.held_blocks) == (1, 0, 0)


def test_read_after_the_lease_expired_is_refused():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(6)  # past P's 5 s lease
    c.p.step()
    assert c.p.finished_sending == {"r1"}  # expired: vLLM frees (and reuses) the blocks
    for b in P_BLOCKS:
        c.overwrite_p_block(b, 99.0)  # another prompt's KV
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.failed_recving == {"d1"} and c.d.finished_recving == {"d1"}
    assert c.d.engine.stats.recv_failures == 1 and c.d.engine.stats.recv_transfers == 0


def test_claim_before_p_knows_the_lease_waits_for_it():
    c = Cluster()
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)  # D faster than P's next step
    c.run(3, nodes=(c.d,))
    assert not c.d.finished_recving
    c.prefill_done("r1", P_BLOCKS)
    c.run(5, dt=0.03)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert c.p.finished_sending == {"r1"}


def test_claim_of_a_lease_p_never_learns_of_fails_by_the_deadline():
    c = Cluster()
    Cluster.recv(c.d, "d1", "nope", D_BLOCKS, P_BLOCKS)
    c.run(60, dt=0.05)  # 3 s: past D's 2 s handshake timeout, which bounds the claim
    assert c.d.failed_recving == {"d1"}


def test_claim_naming_blocks_the_lease_does_not_hold_is_refused():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, (1, 2, 9))  # block 9 belongs to someone else
    c.run()
    assert c.d.failed_recving == {"d1"}


def test_read_slower_than_the_claim_hold_fails():
    """The read outlives P's hold: the load fails, but only once the read ended (no engine stops a
    released read: it lands at 30 s), so vLLM never reuses blocks it may still write."""
    c = Cluster(d_extra=CLAIM_ONLY, d_delay_s=30.0)  # the read takes longer than P's hold (its 10 s transfer timeout)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    c.clock.advance(9.6)  # past 0.95 of P's 10 s hold, before P's claim ends
    c.run(2)
    assert not c.d.failed_recving and c.d.engine.stats.settling_loads == 1, "reported with its read still moving"
    c.clock.advance(21)  # the read lands
    c.run(2)
    assert c.d.failed_recving == {"d1"} and c.d.engine.stats.settled_loads == 1
    assert c.d.engine.stats.settling_loads == 0


def test_read_slower_than_the_claim_hold_fails_at_once_where_release_aborts():
    c = Cluster(d_extra=CLAIM_ONLY, d_delay_s=30.0, aborting=True)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    c.clock.advance(9.6)
    c.run(2)
    assert c.d.failed_recving == {"d1"}
    assert not np.array_equal(c.d.block(5), c.p.block(1)), "the aborted read still landed"


def test_lost_claim_answer_fails_at_the_transfer_deadline_and_p_frees():
    c = Cluster(d_extra=CLAIM_ONLY)
    c.prefill_done("r0", (8,))
    Cluster.recv(c.d, "d0", "r0", (9,), (8,))  # hand-shakes (cached) and loads one block
    c.run()
    assert c.d.finished_recving == {"d0"}
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add(f"127.0.0.1:{P_PORT}")  # P's side channel stops answering (the claim)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    assert c.d.finished_recving == {"d0"}, "a read counted without P's claim"
    c.clock.advance(11)
    c.run(2)
    assert c.d.failed_recving == {"d1"}
    assert "r1" in c.p.finished_sending  # D's failure notice (or else the lease) frees P's blocks


def test_a_second_reader_keeps_the_blocks_until_its_own_notice():
    leases = SendLeases()
    leases.add("k", "r", (1, 2), now=0.0, lease_s=5)
    assert leases.claim("k", "D1", (1, 2), now=1.0, hold_s=10).result is ClaimResult.GRANTED
    assert leases.claim("k", "D2", (2,), now=1.0, hold_s=10).result is ClaimResult.GRANTED
    leases.notice("k", now=2.0, consumer="D1")
    assert leases.take_finished(3.0) == (set(), set()), "freed while D2 still reads"
    leases.notice("k", now=3.0, consumer="D2")
    assert leases.take_finished(3.0) == ({"r"}, set())
    assert leases.claim("k", "D3", (1,), now=4.0, hold_s=10).result is ClaimResult.GONE


def test_released_lease_is_refused_to_a_later_reader():
    leases = SendLeases()
    leases.notice("k", now=0.0, consumer="D0")  # D released before P's worker added the lease
    assert leases.claim("k", "D1", (1,), now=0.5, hold_s=10).result is ClaimResult.GONE
    leases.add("k", "r", (1,), now=1.0, lease_s=5)
    assert leases.take_finished(1.0) == ({"r"}, set())
    assert leases.claim("k", "D1", (1,), now=2.0, hold_s=10).result is ClaimResult.GONE
    assert leases.claim("other", "D1", (1,), now=2.0, hold_s=10).result is ClaimResult.PENDING


def test_claim_extends_the_lease_to_the_hold():
    leases = SendLeases()
    leases.add("k", "r", (1,), now=0.0, lease_s=2)
    assert leases.claim("k", "D", (1,), now=1.0, hold_s=10).result is ClaimResult.GRANTED
    assert leases.take_finished(5.0) == (set(), set())
    assert leases.take_finished(11.5) == (set(), {"r"})


def test_gone_keys_are_bounded():
    leases = SendLeases(gone_cap=3)
    for i in range(10):
        leases.add(f"k{i}", f"r{i}", (i,), now=0.0, lease_s=1)
    leases.take_finished(2.0)
    assert leases.claim("k9", "D", (9,), now=2.0, hold_s=1).result is ClaimResult.GONE
    assert leases.claim("k0", "D", (0,), now=2.0, hold_s=1).result is ClaimResult.PENDING  # forgotten: never granted


def test_renew_keeps_a_queued_requests_lease():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    reply = (
        c.fabric.client()
        .submit("127.0.0.1", P_PORT, wire.RenewRequest("D", ["r1", "zz"]), c.d.engine.parts.compat.hash(), 1)
        .result()
    )
    assert isinstance(reply, wire.RenewReply) and reply.known == [True, False] and reply.lease_s == 5
    c.clock.advance(4)
    c.fabric.client().submit("127.0.0.1", P_PORT, wire.RenewRequest("D", ["r1"]), c.d.engine.parts.compat.hash(), 1)
    c.clock.advance(4)  # 8 s after the prefill: expired without the renewal
    c.p.step()
    assert not c.p.finished_sending
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)


def test_requests_without_our_hash_are_refused():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    client = c.fabric.client()
    for body in (
        wire.ClaimRequest("X", [wire.ClaimItem("r1", [1])]),
        wire.PushRequest("r1", "X", "x", "x", []),
        wire.RenewRequest("X", ["r1"]),
    ):
        future = client.submit("127.0.0.1", P_PORT, body, "0" * 32, 1)
        assert "incompatible" in str(future.exception())
    c.p.step()
    assert c.p.engine.stats.held_blocks == 3, "a message without our hash changed P's leases"


def test_heartbeats_keep_the_lease_of_a_request_queued_on_d():
    from kv_connectors.specs import StepMetadata

    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    peer = ProducerAddress("P", "127.0.0.1", P_PORT)
    c.d.step(StepMetadata(renew_start={"d1": (peer, "r1", None)}))  # D's scheduler: d1 still queued
    for _ in range(40):  # 20 s queued: 4x P's 5 s lease
        c.run(1, dt=0.5)
    assert not c.p.finished_sending, "P freed the blocks while D renewed the lease"
    assert c.d.engine.stats.lease_renewals > 0
    c.d.step(StepMetadata(renew_stop={"d1"}))
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)


def test_a_d_that_stops_renewing_loses_the_lease():
    from kv_connectors.specs import StepMetadata

    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.d.step(StepMetadata(renew_start={"d1": (ProducerAddress("P", "127.0.0.1", P_PORT), "r1", None)}))
    c.run(4, dt=0.5)
    c.d.step(StepMetadata(renew_stop={"d1"}))  # e.g. D's request was aborted
    renewals = len([m for m in c.fabric.requests if isinstance(m, wire.RenewRequest)])
    for _ in range(14):
        c.run(1, dt=0.5)
    assert len([m for m in c.fabric.requests if isinstance(m, wire.RenewRequest)]) == renewals
    assert c.p.finished_sending == {"r1"} and c.p.engine.stats.expired_leases == 1


def test_push_request_for_a_freed_lease_fails_at_once():
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(6)
    c.p.step()  # expired
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    assert c.d.failed_recving == {"d1"}, "D waited for a push of blocks P no longer holds"


def test_push_request_for_a_freed_lease_fails_at_once_on_an_idle_producer():
    """A P with nothing left to do does not step (vLLM's engine waits for a request): the push
    request's answer itself refuses a lease that ended, instead of D waiting out its deadline."""
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(6)
    c.p.step()  # expired; P now idle
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3, nodes=(c.d,))
    assert c.d.failed_recving == {"d1"}, "D waited for a producer that does not step"
    # A release of that lease is not an error (nothing left to free).
    Cluster.recv(c.d, "d2", "r1", (), (), report=False)
    c.run(3, nodes=(c.d,))
    assert c.d.engine.stats.recv_failures == 1


def test_push_under_a_live_lease_writes_d_blocks():
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert c.p.finished_sending == {"r1"} and c.p.engine.stats.pushes == 1


def test_the_claim_leaves_before_the_read_is_posted():
    """Engines may copy inside the post call (NIXL over cma): the claim goes first, so that its round
    trip overlaps the copy instead of following it."""
    c = Cluster(d_extra=CLAIM_ONLY)
    c.prefill_done("r1", P_BLOCKS)
    claims_at_post: list[int] = []
    post_read = c.d.transport.post_read

    def recording(*args, **kwargs):
        claims_at_post.append(sum(isinstance(m, wire.ClaimRequest) for m in c.fabric.requests))
        return post_read(*args, **kwargs)

    c.d.transport.post_read = recording
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert claims_at_post == [1], "the read was posted before its claim was sent"
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)


def _slow_handshake_load(d_extra: dict) -> Cluster:
    """D takes a load whose producer's handshake answer comes back only after 8 s (P's lease is 5 s):
    the answer's network is slow, P itself answers everything else at once."""
    c = Cluster(d_extra={"handshake_timeout_s": 20, **d_extra})
    c.prefill_done("r1", P_BLOCKS)
    c.d.client.hold_types = (wire.HandshakeRequest,)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    for _ in range(16):  # 8 s in the handshake
        c.run(1, dt=0.5)
    assert not c.d.finished_recving and not c.d.failed_recving
    c.d.client.hold_types = ()
    c.d.client.deliver()
    c.run(10)
    return c


def test_heartbeats_keep_p_lease_while_a_loads_handshake_waits():
    """From the moment D has a load, not only while it is queued: a handshake that outlives P's lease
    (a producer slow to answer, or a slow connect) must not cost the request its KV."""
    c = _slow_handshake_load({})
    assert c.p.engine.stats.expired_leases == 0, "P's lease expired while D waited on the handshake"
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert c.d.engine.stats.lease_renewals > 0


def test_heartbeats_keep_p_lease_while_a_push_loads_handshake_waits():
    c = _slow_handshake_load({"mode": "push"})
    assert c.p.engine.stats.expired_leases == 0, "P's lease expired while D waited on the handshake"
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)


def test_a_quick_load_sends_no_heartbeat():
    """Heartbeats start only for a load older than lease_renew_after_s: a load done in milliseconds
    costs P no extra message."""
    c = Cluster(d_extra=CLAIM_ONLY)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(20, dt=0.01)
    assert c.d.finished_recving == {"d1"}
    assert not [m for m in c.fabric.requests if isinstance(m, wire.RenewRequest)]
