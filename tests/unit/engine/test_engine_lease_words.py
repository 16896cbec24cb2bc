"""The fence's one-sided path (kv_connectors.fence), over the memory transport with a fake clock: a
read proved by P's lease words needs no claim; words that prove nothing (a lease not added yet,
ended, or sharing a block with a later lease) fall back to the claim, and a read that spans the end
of its lease fails, never counts with another prompt's KV."""

from __future__ import annotations

import numpy as np

from kv_connectors import wire
from kv_connectors.fence import LeaseWords, lease_word
from kv_connectors.producer.leases import SendLeases
from tests.unit.engine.engine_harness import P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)


def _loaded(c: Cluster) -> bool:
    return all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))


def _claims(c: Cluster) -> list[wire.ClaimRequest]:
    return [m for m in c.fabric.requests if isinstance(m, wire.ClaimRequest)]


def test_words_of_a_live_lease_prove_the_read_without_a_claim():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.d.step()  # one step: the read (copied at its first poll) and its words read complete in it
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert _claims(c) == [], "a claim round trip although the lease words proved the read"
    assert c.d.engine.stats.reads_fenced_by_words == 1
    c.run()
    assert c.p.finished_sending == {"r1"}, "P did not free the blocks on D's notice"
    assert c.p.engine.stats.claims_granted == 0 and c.p.engine.stats.claims_refused == 0


def test_words_are_read_only_after_the_data_read_is_complete():
    """Read before the data has landed, the words would prove nothing about the bytes read later."""
    c = Cluster(d_delay_s=0.05)  # every transfer of D's takes 50 ms
    c.prefill_done("r1", P_BLOCKS)
    loaded_at_post: list[bool] = []  # per read posted: D's blocks already held P's KV
    post_read = c.d.transport.post_read

    def recording(peer, plan, notif):
        loaded_at_post.append(_loaded(c))
        return post_read(peer, plan, notif)

    c.d.transport.post_read = recording
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(10, dt=0.02)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert loaded_at_post == [False, True], "the words were read before the data landed"
    assert _claims(c) == []


def test_a_lease_that_expires_during_the_read_fails_the_load():
    """The unkind timing the words exist for: D's read is in flight when P's lease ends and another
    prompt overwrites the blocks. The words, read after, are cleared: D claims, P refuses, the load
    fails (recomputed), it never counts with the other prompt's KV."""
    c = Cluster(d_delay_s=0.5)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(1, dt=0.01)
    assert not c.d.finished_recving  # the read is in flight
    c.clock.advance(5.0)  # past P's 5 s lease
    c.p.step()
    assert c.p.finished_sending == {"r1"}  # expired: vLLM frees and reuses the blocks
    for b in P_BLOCKS:
        c.overwrite_p_block(b, 99.0)  # another prompt's KV, read by D's late copy
    c.run(10, dt=0.2)
    assert c.d.failed_recving == {"d1"} and c.d.finished_recving == {"d1"}
    assert c.d.engine.stats.reads_fenced_by_words == 0 and c.d.engine.stats.stale_reads_refused == 1
    assert len(_claims(c)) == 1  # the words proved nothing: the claim decided


def test_words_before_p_knows_the_lease_fall_back_to_the_claim_which_waits():
    c = Cluster()
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)  # D faster than P's next step: no words yet
    c.run(3, nodes=(c.d,))
    assert not c.d.finished_recving and len(_claims(c)) >= 1
    c.prefill_done("r1", P_BLOCKS)
    c.run(5, dt=0.03)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert c.d.engine.stats.reads_fenced_by_words == 0 and c.p.engine.stats.claims_granted == 1


def test_a_block_shared_with_a_later_lease_falls_back_to_the_claim():
    """P's prefix cache shares block 3 between r1 and r2: its word is r2's, so r1's read is claimed;
    r2's own read is proved by its words."""
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.prefill_done("r2", (3, 4))
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert [i.key for m in _claims(c) for i in m.items] == ["r1"]
    Cluster.recv(c.d, "d2", "r2", (8, 9), (3, 4))
    c.run()
    assert "d2" in c.d.finished_recving and not c.d.failed_recving
    assert c.d.engine.stats.reads_fenced_by_words == 1 and len(_claims(c)) == 1


def test_a_failing_words_read_falls_back_to_the_claim():
    from kv_connectors.errors import TransportError

    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    post_read = c.d.transport.post_read
    calls: list[int] = []

    def second_fails(peer, plan, notif):
        calls.append(plan.num_runs)
        if len(calls) == 2:
            raise TransportError("injected: the words read failed")
        return post_read(peer, plan, notif)

    c.d.transport.post_read = second_fails
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert len(calls) == 2 and len(_claims(c)) == 1 and c.d.engine.stats.reads_fenced_by_words == 0


def test_words_of_a_restarted_producer_prove_nothing():
    """Words are the lease key's under P's epoch: a new process's lease on the same key (a retried
    transfer id) does not prove a read planned against the old one."""
    assert lease_word("epoch-1", "k") != lease_word("epoch-2", "k")
    assert lease_word("e", "k1") != lease_word("e", "k2") and lease_word("e", "k") == lease_word("e", "k")


def test_a_bad_words_address_from_the_producer_is_ignored():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    server = c.fabric.servers[("127.0.0.1", P_PORT)]
    sender_reply = server.handler

    def bad_address(body):
        reply = sender_reply(body)
        if isinstance(reply, wire.HandshakeReply):
            import msgspec

            return msgspec.structs.replace(reply, lease_words=2**63 - 8)
        return reply

    server.handler = bad_address
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert len(_claims(c)) == 1 and c.d.engine.stats.reads_fenced_by_words == 0


def test_lease_words_follow_the_leases():
    words = LeaseWords(8)
    leases = SendLeases(words=words, epoch="e")
    leases.add("a", "ra", (1, 2, 3), now=0.0, lease_s=5)
    wa, wb = lease_word("e", "a"), lease_word("e", "b")
    assert words.all_equal(wa, (1, 2, 3))
    leases.add("b", "rb", (3, 4), now=0.0, lease_s=10)  # shares block 3: the later lease's word
    assert words.all_equal(wa, (1, 2)) and words.all_equal(wb, (3, 4)) and not words.all_equal(wa, (3,))
    leases.notice("a", now=1.0)  # a ends: its own words cleared, b's block 3 kept
    assert not words.all_equal(wa, (1,)) and not words.all_equal(wa, (2,)) and words.all_equal(wb, (3, 4))
    assert leases.take_finished(1.0) == ({"ra"}, set())
    assert leases.take_finished(11.0) == (set(), {"rb"})  # b expires: cleared before it is reported
    assert not any(words.all_equal(w, (i,)) for w in (wa, wb) for i in range(8))
    assert not words.all_equal(wa, ())  # no blocks prove nothing
