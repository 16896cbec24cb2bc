"""Each phase of a transfer against what can go wrong in it (memory transport, fake clock): a release
or notice at each point, a peer that dies or stops answering in each phase, each phase's deadline,
layer-wise push with D late, start-up and shut-down. Every test checks what a peer or vLLM would
see: which requests finish or fail, which blocks P frees and why (notice, failed write or lease
expiry: the counters tell them apart), and whether the bytes landed."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kv_connectors import wire
from kv_connectors.config import parse_config
from kv_connectors.consumer.tasks import RecvKind
from kv_connectors.errors import TransportError
from kv_connectors.producer.leases import SendLeases
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from kv_connectors.transports.base import MemoryKind
from kv_connectors.transports.memory import MemoryFabric, MemoryTransport, host_layout
from kv_connectors.worker import WorkerEngine
from tests.unit.engine.engine_harness import BLOCK_SIZE, BLOCK_WORDS, CLAIM_ONLY, NUM_BLOCKS, P_PORT, Cluster, compat_for

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)
ANY_P = ProducerAddress("", "127.0.0.1", P_PORT)
P_SIDE_CHANNEL = f"127.0.0.1:{P_PORT}"


def _loaded(c: Cluster) -> bool:
    return all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))


def _untouched(c: Cluster) -> bool:
    """D's blocks still hold D's own values (fill -1): nothing was written into them."""
    return all(np.all(c.d.block(d) == -(d + 1)) for d in D_BLOCKS)


def _recv(node, rid, spec: RecvSpec) -> None:
    node.step(StepMetadata(reqs_to_recv={rid: spec}))


def _hand_shake(c: Cluster, dt: float = 0.001) -> None:
    """One complete load, so that D has P's handshake cached and P is connected to D."""
    c.prefill_done("r0", (8,))
    Cluster.recv(c.d, "d0", "r0", (9,), (8,))
    c.run(dt=dt)
    assert c.d.finished_recving == {"d0"} and not c.d.failed_recving


def _requests(c: Cluster, kind: type) -> int:
    return sum(isinstance(m, kind) for m in c.fabric.requests)


# releases and notices at each phase ----------------------------------------------------------------
def test_release_before_p_knows_the_lease_frees_it_when_it_arrives():
    """D's release (aborted, or all cached) reaches P before P's worker added the lease: the
    lease ends the moment it is added, as a completed send, not at its expiry."""
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(PEER, "r1", (), (), report=False))
    c.run(2)  # P's worker steps too: the notice is taken before the lease exists
    assert not c.p.finished_sending and c.p.engine.stats.held_blocks == 0
    c.prefill_done("r1", P_BLOCKS)
    assert c.p.finished_sending == {"r1"}
    s = c.p.engine.stats
    assert (s.completed_sends, s.expired_leases, s.held_blocks) == (1, 0, 0)


def test_release_while_the_handshake_hangs_is_left_to_the_lease():
    """D releases while P's side channel does not answer: D gives up at its deadline without
    counting a failed load, and P's lease (not a notice) frees the blocks."""
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add(P_SIDE_CHANNEL)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", (), (), report=False))
    c.run(3)
    c.clock.advance(13)  # past D's handshake + transfer deadlines and P's 5 s lease
    c.run(2)
    assert not c.d.finished_recving and c.d.engine.stats.recv_failures == 0
    assert c.p.finished_sending == {"r1"}
    s = c.p.engine.stats
    assert (s.completed_sends, s.expired_leases) == (0, 1)


def test_push_notice_before_the_acknowledgement_completes_the_load():
    """P writes and notifies before its PushAck reaches D: the notice settles the task, and the
    late acknowledgement changes nothing."""
    c = Cluster(d_extra={"mode": "push"})
    _hand_shake(c)
    c.prefill_done("r1", P_BLOCKS)
    c.d.client.holding = True  # P gets the push request at once; its answer is held back
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    assert c.d.finished_recving == {"d0", "d1"} and not c.d.failed_recving and _loaded(c)
    c.d.client.holding = False
    assert c.d.client.deliver() == 1  # the held PushAck; its future was cancelled
    c.run(2)
    assert c.d.finished_recving == {"d0", "d1"} and not c.d.failed_recving
    assert c.d.engine.stats.recv_transfers == 2 and c.p.finished_sending == {"r0", "r1"}


# the handshake -------------------------------------------------------------------------------------
def test_a_different_engine_at_the_producers_address_fails_the_load():
    """The side channel at P's address answers for another engine (P restarted under a new id, or
    a port reused): D reads nothing and fails the request."""
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(ProducerAddress("P-old", "127.0.0.1", P_PORT), "r1", D_BLOCKS, P_BLOCKS))
    c.run()
    assert c.d.failed_recving == {"d1"} and c.d.transport.posted == 0 and _untouched(c)


def test_producer_that_cannot_connect_to_d_fails_the_push_and_frees_at_once_d_at_its_deadline():
    """D's handshake carries transport metadata P cannot connect with: P logs it, fails the push at
    once and frees the blocks without waiting for the lease; D, which P cannot notify, fails at its
    own deadline."""
    c = Cluster(d_extra={"mode": "push"})
    c.d.engine.parts.receiver.producers._local_metadata = b"not D's agent"
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert not c.d.finished_recving
    c.clock.advance(11)
    c.run(2)
    assert c.d.failed_recving == {"d1"} and _untouched(c)
    s = c.p.engine.stats
    assert (s.push_failures, s.pushes, s.expired_leases) == (1, 0, 0)
    assert c.p.finished_sending == {"r1"}


# the push request ----------------------------------------------------------------------------------
def test_push_request_p_refuses_fails_at_once():
    """More blocks than P's whole cache: P refuses the push request in its answer."""
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    local = tuple(range(NUM_BLOCKS)) + (0,)
    Cluster.recv(c.d, "d1", "r1", local, local)
    c.run(2)
    assert c.d.failed_recving == {"d1"}
    assert c.p.engine.stats.push_failures == 0, "a refused request reached P's queue"


def test_push_request_to_a_dead_side_channel_fails_at_once():
    c = Cluster(d_extra={"mode": "push"})
    _hand_shake(c)
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.dead.add(P_SIDE_CHANNEL)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    assert c.d.failed_recving == {"d1"} and _untouched(c)


def test_transfer_id_decode_whose_prefill_never_comes_fails_at_its_deadline():
    """D waits for P's notification (push wait); P never computes the request: D fails at its
    transfer deadline, and P drops the waiting push request at its own."""
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-never", D_BLOCKS, ()))
    c.run(3)
    c.clock.advance(5)
    c.run(2)
    assert not c.d.finished_recving, "failed before its deadline"
    c.clock.advance(6)  # past D's and P's 10 s transfer timeouts
    c.run(2)
    assert c.d.failed_recving == {"d1"} and _untouched(c)
    assert c.p.engine.stats.push_failures == 1


def test_push_request_arriving_after_the_cancel_is_forgotten_waits_for_its_deadline():
    """A cancelled transfer id is remembered 600 s: a push request after that is kept waiting
    (P may still compute it) and fails at its deadline, not at once."""
    c = Cluster()
    c.p.step(StepMetadata(transfers_cancelled={"xfer-1": "prefill request p-req ended with status aborted"}))
    c.clock.advance(601)
    c.p.step()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(3)
    assert not c.d.finished_recving and c.p.engine.stats.push_failures == 0
    c.clock.advance(11)
    c.run(2)
    assert c.d.failed_recving == {"d1"} and c.p.engine.stats.push_failures == 1


# P's write (push) ----------------------------------------------------------------------------------
def test_lease_deadline_passing_during_a_write_does_not_free_the_blocks():
    """P's 5 s lease ends while its write into a slow D is in flight: the lease is held until the
    write settles; then the blocks are freed as sent, never as expired."""
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("D-rank0")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    c.clock.advance(6)  # past the lease, within P's 10 s transfer timeout
    c.run(2)
    assert not c.p.finished_sending and c.p.engine.stats.expired_leases == 0
    c.fabric.frozen.discard("D-rank0")
    c.run(3)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    s = c.p.engine.stats
    assert c.p.finished_sending == {"r1"} and (s.pushes, s.push_failures, s.expired_leases) == (1, 0, 0)


def test_decoder_dying_mid_write_fails_the_push_and_frees_at_once():
    """D dies while P's write is in flight: the write fails (push_failures), and P frees the
    blocks then, long before the lease would (expired_leases stays 0)."""
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("D-rank0")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    assert c.p.transport.posted == 1 and not c.p.finished_sending
    c.fabric.dead.add("D-rank0")
    c.run(1, nodes=(c.p,))
    s = c.p.engine.stats
    assert c.p.finished_sending == {"r1"}
    assert (s.push_failures, s.pushes, s.expired_leases, s.held_blocks) == (1, 0, 0, 0)


def test_closing_p_aborts_its_writes_in_flight():
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("D-rank0")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    (handle,) = c.p.engine.parts.sender.writes._writing[("r1", "D-rank0", "d1")].handles
    c.p.engine.close()
    assert ("127.0.0.1", P_PORT) not in c.fabric.servers and "P-rank0" not in c.fabric.agents
    c.fabric.frozen.discard("D-rank0")
    with pytest.raises(TransportError, match="released"):
        c.p.transport.poll(handle)
    c.fabric.drive()  # P's memory is gone with its transport: it never copies
    assert _untouched(c)
    c.clock.advance(11)
    c.run(2, nodes=(c.d,))
    assert c.d.failed_recving == {"d1"}  # D's abort finds nobody at P's address


# layer-wise push -----------------------------------------------------------------------------------
def test_layerwise_with_d_late_pushes_the_whole_request_from_the_lease():
    """D's push request reaches P only after P's forward pass: no layer-wise write; the lease
    (keyed by the transfer id) serves it whole."""
    c = Cluster()
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "xfer-1")}), layers=("layer.0", "layer.1"))
    assert c.p.transport.posted == 0
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))
    c.clock.advance(3)  # D late, within P's 5 s lease
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    s = c.p.engine.stats
    assert (s.pushes, s.layerwise_pushes, s.expired_leases) == (1, 0, 0)
    assert c.p.finished_sending == {"p-req"}


def test_layerwise_with_d_later_than_the_lease_fails_at_once():
    c = Cluster()
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "xfer-1")}), layers=("layer.0", "layer.1"))
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))
    c.clock.advance(6)
    c.p.step()
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.expired_leases == 1
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(3)
    assert c.d.failed_recving == {"d1"} and _untouched(c)


def test_layerwise_asking_for_more_blocks_than_p_computed_is_refused_whole():
    """D names more blocks than P's request holds: no layer is written during the forward pass,
    and the whole-request path refuses it once the prefill finishes."""
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", (4, 5, 6, 7), ()))
    c.run(2)
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "xfer-1")}), layers=("layer.0", "layer.1"))
    assert c.p.transport.posted == 0
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))
    c.run(2)
    assert c.d.failed_recving == {"d1"} and c.p.engine.stats.push_failures == 1
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.expired_leases == 0


def test_layerwise_cancelled_before_its_first_layer_writes_nothing():
    """The step that starts a layer-wise push also cancels the transfer: no layer is written,
    D is told at once."""
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(2)
    meta = StepMetadata(
        reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "xfer-1")},
        transfers_cancelled={"xfer-1": "prefill request p-req ended with status aborted"},
    )
    c.p.step(meta, layers=("layer.0", "layer.1"))
    c.run(2)
    assert c.p.transport.posted == 0
    assert c.d.failed_recving == {"d1"} and _untouched(c)
    assert c.p.engine.stats.push_failures == 1


def test_layerwise_write_failing_mid_forward_aborts_the_rest_and_frees_p():
    """Layer 0's write is in flight (slow D) when layer 1's post fails: the push fails, layer 0's
    write runs to its end (no engine stops it), and only then is D told and P frees the blocks."""
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(2)
    c.fabric.frozen.add("D-rank0")
    c.p.engine.before_forward(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))
    c.p.engine.start_load(None)
    c.p.engine.on_layer_saved("layer.0")
    c.p.transport.fail_next_post = TransportError("link down")
    c.p.engine.on_layer_saved("layer.1")
    c.p.engine.end_of_forward()
    c.p.step()
    assert c.p.transport.posted == 1 and c.p.engine.stats.push_failures == 0, "D told with layer 0 in flight"
    c.fabric.frozen.discard("D-rank0")
    c.run(2)
    assert c.p.engine.stats.push_failures == 1 and c.d.failed_recving == {"d1"}
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.expired_leases == 0


def test_layerwise_lease_added_in_the_same_step_is_held_during_the_write():
    """The lease is known before the layer-wise write settles: it outlives its deadline while the
    write is in flight, and ends as a completed send."""
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(2)
    c.fabric.frozen.add("D-rank0")
    spec = SendSpec(P_BLOCKS, "xfer-1")
    c.p.step(StepMetadata(reqs_layerwise={"p-req": spec}, reqs_to_send={"p-req": spec}), layers=("layer.0", "layer.1"))
    c.clock.advance(6)  # past P's 5 s lease
    c.run(2)
    assert not c.p.finished_sending and c.p.engine.stats.expired_leases == 0
    c.fabric.frozen.discard("D-rank0")
    c.run(3)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    s = c.p.engine.stats
    assert (s.pushes, s.layerwise_pushes, s.expired_leases) == (1, 1, 0)
    assert c.p.finished_sending == {"p-req"}


# the read (pull) and its claim ---------------------------------------------------------------------
def test_producer_dying_mid_read_fails_the_load_and_the_next_one_hand_shakes_again():
    c = Cluster(d_extra=CLAIM_ONLY, d_delay_s=0.5)
    _hand_shake(c, dt=0.2)
    handshakes = _requests(c, wire.HandshakeRequest)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    assert "d1" not in c.d.finished_recving  # the read is in flight
    c.fabric.dead.add("P-rank0")
    c.run(1, nodes=(c.d,))
    assert c.d.failed_recving == {"d1"} and _untouched(c)
    c.fabric.dead.discard("P-rank0")
    c.prefill_done("r2", P_BLOCKS)
    Cluster.recv(c.d, "d2", "r2", D_BLOCKS, P_BLOCKS)
    c.run(3, dt=0.6)
    assert "d2" in c.d.finished_recving and "d2" not in c.d.failed_recving and _loaded(c)
    assert _requests(c, wire.HandshakeRequest) == handshakes + 1


def test_read_completing_after_the_hold_ends_is_refused(caplog):
    """The read outlives 0.95 of P's hold before D sees it complete (a long stall between steps):
    the bytes are there, yet the load fails, since P may have reused the blocks meanwhile."""
    c = Cluster(d_extra=CLAIM_ONLY, d_delay_s=9.0)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(1)  # the claim is granted: hold 10 s from its sending
    assert not c.d.finished_recving
    c.clock.advance(9.8)  # one step much later: the read is done, past sent_at + 9.5 s
    with caplog.at_level(logging.ERROR, logger="kv_connectors.consumer"):
        c.run(1, nodes=(c.d,))
    assert c.d.failed_recving == {"d1"}
    assert "the read completed after the producer's hold" in caplog.text
    assert c.d.engine.stats.recv_transfers == 0


def test_claim_failing_on_the_side_channel_fails_the_read_and_tells_p():
    """The read completes, but P's side channel is gone when D claims: D fails the load and tells
    P over the transport, which frees the blocks at once (no lease expiry)."""
    c = Cluster(d_extra=CLAIM_ONLY)
    _hand_shake(c)
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.dead.add(P_SIDE_CHANNEL)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    assert c.d.failed_recving == {"d1"}
    s = c.p.engine.stats
    assert "r1" in c.p.finished_sending and s.expired_leases == 0 and s.held_blocks == 0


def test_unanswered_claim_with_p_unreachable_fails_at_the_deadline_and_the_lease_frees():
    """Neither the claim's answer nor D's failure notice can reach P: D fails at its deadline
    (without raising), and P's lease frees the blocks."""
    c = Cluster(d_extra=CLAIM_ONLY)
    _hand_shake(c)
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add(P_SIDE_CHANNEL)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    c.fabric.dead.add("P-rank0")  # the read had completed at once; now the transport is gone too
    c.clock.advance(11)
    c.run(2)
    assert c.d.failed_recving == {"d1"}
    s = c.p.engine.stats
    assert c.p.finished_sending == {"r0", "r1"} and (s.completed_sends, s.expired_leases) == (1, 1)


def test_a_bug_in_the_transport_fails_that_load_not_the_step(monkeypatch):
    """An unexpected exception while advancing a task fails that task; the engine keeps serving."""
    c = Cluster(d_delay_s=0.01)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    real_poll = c.d.transport.poll

    def broken(handle):
        raise RuntimeError("bug")

    monkeypatch.setattr(c.d.transport, "poll", broken)
    c.run(1, nodes=(c.d,))
    assert not c.d.finished_recving, "reported with its read in flight"
    monkeypatch.setattr(c.d.transport, "poll", real_poll)
    c.run(2, dt=0.01)  # the read ends: the failure is reported
    assert c.d.failed_recving == {"d1"}
    assert "r1" in c.p.finished_sending and c.p.engine.stats.expired_leases == 0  # D's failure notice
    c.prefill_done("r2", P_BLOCKS)
    Cluster.recv(c.d, "d2", "r2", D_BLOCKS, P_BLOCKS)
    c.run(3, dt=0.02)
    assert "d2" in c.d.finished_recving and "d2" not in c.d.failed_recving and _loaded(c)


def test_a_bug_while_a_push_waits_fails_that_push_not_the_step(monkeypatch):
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    leases = c.p.engine.parts.sender.leases

    def broken(key):
        raise RuntimeError("bug")

    monkeypatch.setattr(leases, "gone", broken)
    c.run(2)
    assert c.d.failed_recving == {"d1"} and c.p.engine.stats.push_failures == 1
    monkeypatch.undo()
    _recv(c.d, "d2", RecvSpec(ANY_P, "xfer-2", D_BLOCKS, ()))
    c.run(2)
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-2")}))
    c.run()
    assert "d2" in c.d.finished_recving and "d2" not in c.d.failed_recving and _loaded(c)


def test_closing_d_releases_its_read_in_flight():
    c = Cluster(d_delay_s=1.0)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(2)
    handle = c.d.engine.parts.receiver._tasks[(RecvKind.LOAD, "d1")].read.handle
    c.d.engine.close()
    assert ("127.0.0.1", 7002) not in c.fabric.servers and "D-rank0" not in c.fabric.agents
    c.clock.advance(2)
    with pytest.raises(TransportError, match="released"):
        c.d.transport.poll(handle)
    c.fabric.drive()  # D's memory is gone with its transport: it never copies
    assert _untouched(c)


# heartbeats ----------------------------------------------------------------------------------------
def test_heartbeats_to_a_frozen_producer_do_not_pile_up():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add(P_SIDE_CHANNEL)
    c.d.step(StepMetadata(renew_start={"d1": (PEER, "r1", None)}))
    c.run(20, dt=0.5, nodes=(c.d,))
    assert _requests(c, wire.RenewRequest) == 1, "a second renewal while the first is unanswered"
    assert c.d.engine.stats.lease_renewals == 0


def test_heartbeats_to_a_dead_side_channel_are_retried(caplog):
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.dead.add(P_SIDE_CHANNEL)
    c.d.step(StepMetadata(renew_start={"d1": (PEER, "r1", None)}))
    with caplog.at_level(logging.WARNING, logger="kv_connectors.consumer.renewer"):
        c.run(4, dt=0.5, nodes=(c.d,))
    assert "could not renew leases" in caplog.text
    assert _requests(c, wire.RenewRequest) >= 2 and c.d.engine.stats.lease_renewals == 0
    c.fabric.dead.discard(P_SIDE_CHANNEL)
    c.run(2, dt=0.5, nodes=(c.d,))
    assert c.d.engine.stats.lease_renewals >= 1


def test_heartbeats_stopped_while_one_is_in_flight_end_after_its_answer():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.d.client.holding = True
    c.d.step(StepMetadata(renew_start={"d1": (PEER, "r1", None)}))
    c.run(1, dt=0.5, nodes=(c.d,))
    c.d.step(StepMetadata(renew_stop={"d1", "never-started"}))
    c.d.client.holding = False
    assert c.d.client.deliver() == 1
    c.run(6, dt=0.5, nodes=(c.d,))
    assert _requests(c, wire.RenewRequest) == 1
    assert c.d.engine.stats.lease_renewals == 1  # the answer still counts: P confirmed the lease


# start-up and results ------------------------------------------------------------------------------
def _engine(fabric: MemoryFabric, make=None, serve=None) -> tuple[WorkerEngine, np.ndarray]:
    cfg = parse_config("E", "kv_producer", {"side_channel_port": P_PORT, "staging": "off"})
    kv = np.zeros((2, NUM_BLOCKS, BLOCK_WORDS), dtype=np.float32)
    engine = WorkerEngine(
        cfg,
        0,
        make or (lambda name: MemoryTransport(name, fabric)),
        "memory",
        serve=serve or fabric.serve,
        client=fabric.client(),
        clock=fabric.clock,
    )
    return engine, kv


def test_failed_registration_frees_the_side_channel_port():
    fabric = MemoryFabric()
    engine, kv = _engine(fabric)
    layout = host_layout(kv, NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(TransportError, match="host memory only"):
        engine.register(layout, compat_for(layout), kind=MemoryKind.DEVICE)
    assert ("127.0.0.1", P_PORT) not in fabric.servers and "E-rank0" not in fabric.agents
    again, kv2 = _engine(fabric)
    layout2 = host_layout(kv2, NUM_BLOCKS, BLOCK_SIZE)
    again.register(layout2, compat_for(layout2))  # the port and the agent name are free again
    assert ("127.0.0.1", P_PORT) in fabric.servers


def test_requests_during_registration_are_answered_not_ready():
    """A peer asking while the KV cache is being registered (the port is bound first) gets an
    error answer, not an exception on the side-channel thread."""
    fabric = MemoryFabric()
    answers: list[wire.Body] = []

    def make(name: str) -> MemoryTransport:  # runs inside register, after the bind
        server_hash = fabric.servers[("127.0.0.1", P_PORT)].compat_hash
        for body in (wire.PushRequest("r1", "X", "x", "x", [1]), wire.ClaimRequest("X", [wire.ClaimItem("r1", [1])])):
            answers.append(fabric.client().submit("127.0.0.1", P_PORT, body, server_hash, 1).exception())
        answers.append(fabric.client().submit("127.0.0.1", P_PORT, wire.StatsRequest(), "", 1).result())
        return MemoryTransport(name, fabric)

    engine, kv = _engine(fabric, make=make)
    layout = host_layout(kv, NUM_BLOCKS, BLOCK_SIZE)
    engine.register(layout, compat_for(layout))
    assert ["not registered yet" in str(a) for a in answers[:2]] == [True, True]
    assert isinstance(answers[2], wire.StatsReply) and answers[2].engine_id == "E"


def test_an_unregistered_engine_steps_and_reports_nothing():
    engine, _kv = _engine(MemoryFabric())
    engine.start_load(StepMetadata(reqs_failed={"d1": "bad params"}))
    assert engine.take_results() == (set(), set(), set())
    assert engine.take_load_durations() == []


def test_load_durations_are_reported_once_each():
    c = Cluster(d_extra=CLAIM_ONLY, d_delay_s=0.5)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3, dt=0.3)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    durations = c.d.engine.take_load_durations()
    assert len(durations) == 1 and 0.5 <= durations[0] <= 0.9
    assert c.d.engine.take_load_durations() == []


def test_early_notice_is_forgotten_after_its_ttl():
    """A notice for a lease P never adds is dropped after 600 s: a lease added later under that
    key is held normally (not ended at once by a stale notice)."""
    leases = SendLeases()
    leases.notice("k", now=0.0)
    leases.take_finished(601.0)
    leases.add("k", "r", (1,), now=601.0, lease_s=5)
    assert leases.block_ids("k") == (1,) and leases.take_finished(602.0) == (set(), set())


# staging over the memory transport ---------------------------------------------------------------
STAGED = {"staging": "on", "staging_pool_kib": 2, "staging_chunk_kib": 1}  # 3 blocks x 2 regions = 1.5 KiB: 2 chunks


def test_staged_pull_moves_the_bytes_through_the_bounded_pool():
    c = Cluster(p_extra=STAGED, d_extra=STAGED)
    _recv(c.d, "d0", RecvSpec(PEER, "r0", (), (), report=False))  # hand-shakes: P connects to D
    c.run(2)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(30)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert "r1" in c.p.finished_sending and c.p.engine.stats.expired_leases == 0
    for node in (c.p, c.d):
        s = node.engine.stats
        assert s.staging_pool_bytes == s.staging_allocated_bytes == 2048
        assert 0 < s.staging_peak_bytes <= 2048


def test_first_staged_pull_after_the_handshake_completes():
    """Once a bug: the worker read the transport's notifications before the sender connected the
    consumers queued by their handshakes, so the first staged Stage from a new D was dropped and D
    waited until its transfer timeout."""
    c = Cluster(p_extra=STAGED, d_extra=STAGED)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(30)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)


# fragmented staging: the KV registered directly too, a plan of many short runs through the pool ---------
FRAGMENTED = {"staging": "fragmented", "staging_pool_kib": 2, "staging_chunk_kib": 1, "staging_fragment_kib": 1}


@pytest.mark.parametrize(("runs", "staged"), [(2, True), (3, False)], ids=["many-short-runs-staged", "few-runs-direct"])
def test_fragmented_staging_picks_each_loads_path_by_its_plan(runs: int, staged: bool) -> None:
    """The load's plan has 2 runs (one per region) of 768 bytes: staged from 2 runs under 1 KiB, direct from 3."""
    extra = {**FRAGMENTED, "staging_fragment_runs": runs}
    c = Cluster(p_extra=extra, d_extra=extra)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(30)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert "r1" in c.p.finished_sending and c.p.engine.stats.expired_leases == 0
    s = c.d.engine.stats
    # the data read, then the lease words' read (one run of 3 words: always direct)
    assert (s.staged_transfers, s.direct_transfers) == ((1, 1) if staged else (0, 2))
    assert s.reads_fenced_by_words == 1, "the lease words were not read (or proved nothing): a claim instead"
    assert not [m for m in c.fabric.requests if isinstance(m, wire.ClaimRequest)]
    assert (s.staging_peak_bytes > 0) is staged, "the pool is used only by a staged load"
    assert s.staging_pool_bytes == 2048


def test_fragmented_staging_reads_shuffled_lease_words_through_the_pool_too() -> None:
    """D's blocks in another order: the words' read is 2 runs, staged like the data, and still proves the read."""
    extra = {**FRAGMENTED, "staging_fragment_runs": 2}
    c = Cluster(p_extra=extra, d_extra=extra)
    shuffled = (7, 5, 6)
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", shuffled, P_BLOCKS)
    c.run(30)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    assert all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, shuffled))
    s = c.d.engine.stats
    assert (s.staged_transfers, s.direct_transfers) == (2, 0)
    assert s.reads_fenced_by_words == 1
    assert not [m for m in c.fabric.requests if isinstance(m, wire.ClaimRequest)]
