"""The engine's other paths over the memory transport with a fake clock: releases, bad params, the
transfer-id flow (push before P computed), aborts, layer-wise push, and each phase's deadline with
a frozen or dead peer. The e2e suite covers these with real servers, but not each timing."""

from __future__ import annotations

import numpy as np

from kv_connectors import wire
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from tests.unit.engine.engine_harness import CLAIM_ONLY, P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)
ANY_P = ProducerAddress("", "127.0.0.1", P_PORT)  # the transfer-id flow may not name P's engine


def _loaded(c: Cluster) -> bool:
    return all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))


def _recv(node, rid, spec: RecvSpec) -> None:
    node.step(StepMetadata(reqs_to_recv={rid: spec}))


def test_release_frees_p_at_once_and_reports_nothing_on_d():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", (), (), report=False))  # aborted before scheduled, or all cached
    c.run()
    assert c.p.finished_sending == {"r1"} and c.p.engine.stats.expired_leases == 0
    assert not c.d.finished_recving and not c.d.failed_recving


def test_release_to_a_dead_producer_is_a_warning_not_a_failed_load():
    c = Cluster()
    c.fabric.dead.add(f"127.0.0.1:{P_PORT}")
    _recv(c.d, "d1", RecvSpec(PEER, "r1", (), (), report=False))
    c.run()
    assert not c.d.failed_recving and c.d.engine.stats.recv_failures == 0


def test_bad_params_fail_the_request_at_once():
    c = Cluster()
    c.d.step(StepMetadata(reqs_failed={"d1": "kv_transfer_params['remote_port'] must be ..."}))
    assert c.d.failed_recving == {"d1"} and c.d.finished_recving == {"d1"}


def test_transfer_id_push_waits_for_ps_prefill_then_writes():
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))  # D first: P has computed nothing yet
    c.run(3)
    assert not c.d.finished_recving
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.pushes == 1


def test_push_request_for_another_prompt_is_refused_and_the_lease_kept():
    """Two prompts under one transfer id (a router reused it): P prefilled one, a D request for the
    other asks for the id. P writes nothing into it (D would decode its prompt from the other's KV)
    and fails it; the lease stays for the D request with the prefill's prompt, which loads."""
    c = Cluster()
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1", prompt_digest="prompt-a")}))
    _recv(c.d, "d-b", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, (), prompt_digest="prompt-b"))
    c.run()
    assert c.d.failed_recving == {"d-b"} and not _loaded(c)
    assert (c.p.engine.stats.pushes, c.p.engine.stats.push_failures) == (0, 1) and not c.p.finished_sending
    _recv(c.d, "d-a", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, (), prompt_digest="prompt-a"))
    c.run()
    assert "d-a" in c.d.finished_recving and "d-a" not in c.d.failed_recving and _loaded(c)
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.pushes == 1


def test_layerwise_push_is_not_started_for_another_prompt():
    """D asked first with another prompt: no layer is written during P's forward pass, and the
    push is refused once the prefill finishes."""
    c = Cluster()
    _recv(c.d, "d-b", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, (), prompt_digest="prompt-b"))
    c.run(2)
    spec = SendSpec(P_BLOCKS, "xfer-1", prompt_digest="prompt-a")
    c.p.step(StepMetadata(reqs_layerwise={"p-req": spec}), layers=("layer.0", "layer.1"))
    assert c.p.transport.posted == 0
    c.p.step(StepMetadata(reqs_to_send={"p-req": spec}))
    c.run()
    assert c.d.failed_recving == {"d-b"} and not _loaded(c) and c.p.engine.stats.layerwise_pushes == 0


def test_a_release_for_another_prompt_frees_nothing():
    """A D request for another prompt under the key (it failed, or hit D's cache) tells P to free the
    blocks: P keeps them for the prefill's own D, before the lease began too. The prefill's own
    prompt's release frees them."""
    c = Cluster()
    _recv(c.d, "d-b", RecvSpec(ANY_P, "xfer-1", (), (), report=False, prompt_digest="prompt-b"))
    c.run(2)  # the release is at P before the prefill finished
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1", prompt_digest="prompt-a")}))
    _recv(c.d, "d-b2", RecvSpec(ANY_P, "xfer-1", (), (), report=False, prompt_digest="prompt-b"))
    c.run()
    assert not c.p.finished_sending and c.p.engine.stats.held_blocks == len(P_BLOCKS)
    _recv(c.d, "d-a", RecvSpec(ANY_P, "xfer-1", (), (), report=False, prompt_digest="prompt-a"))
    c.run()
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.held_blocks == 0


def test_a_push_request_or_prefill_without_a_digest_is_written():
    """A side that states no digest (a D of an earlier release, P without token ids) is not checked."""
    for p_digest, d_digest in (("prompt-a", ""), ("", "prompt-a")):
        c = Cluster()
        c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1", prompt_digest=p_digest)}))
        _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, (), prompt_digest=d_digest))
        c.run()
        assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c), (p_digest, d_digest)


def test_aborted_prefill_fails_the_waiting_push_at_once():
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(2)
    c.p.step(StepMetadata(transfers_cancelled={"xfer-1": "prefill request p-req ended with status aborted"}))
    c.run(2)
    assert c.d.failed_recving == {"d1"}
    assert c.p.engine.stats.push_failures == 1


def test_push_request_after_the_abort_fails_too():
    c = Cluster()
    c.p.step(StepMetadata(transfers_cancelled={"xfer-1": "prefill request p-req ended with status aborted"}))
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(3)
    assert c.d.failed_recving == {"d1"}


def test_layerwise_push_writes_each_layer_during_the_forward_pass():
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(2)  # D's push request is at P before P computes
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "xfer-1")}), layers=("layer.0", "layer.1"))
    assert c.p.transport.posted == 2, "one write per layer, posted from the layer hooks"
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1")}))  # the prefill finished
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving and _loaded(c)
    s = c.p.engine.stats
    assert (s.pushes, s.layerwise_pushes) == (1, 1)
    assert c.p.finished_sending == {"p-req"}


def test_layerwise_push_aborted_mid_forward_holds_blocks_until_writes_settle():
    c = Cluster()
    c.fabric.frozen.add("D-rank0")  # D's memory stops taking writes: they stay in flight
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(2, nodes=(c.d,))
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "xfer-1")}), layers=("layer.0",))
    # The request is aborted: its blocks stay held (cancelled=True) while the write is in flight.
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(P_BLOCKS, "xfer-1", cancelled=True)}))
    c.run(3, nodes=(c.p,))
    assert not c.p.finished_sending, "P freed blocks a write was still reading"
    c.fabric.frozen.discard("D-rank0")
    c.run(3)
    assert c.p.finished_sending == {"p-req"}
    # The forward pass had computed every layer (layer-wise push only covers prefills one step
    # completes), so the writes in flight carry the prompt's KV: D may use it, or fail; never other KV.
    assert "d1" in c.d.finished_recving
    assert "d1" in c.d.failed_recving or _loaded(c)


def test_push_write_to_a_frozen_decoder_times_out_and_frees_p():
    """P's write into a frozen D times out; no engine stops it, so P holds the blocks it reads and
    D (its abort answered "not settled") the blocks it writes, until the write ended: it lands when
    D resumes, and counts (whole and under the lease)."""
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("D-rank0")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    assert not c.p.finished_sending
    c.clock.advance(11)  # past P's 10 s transfer timeout, and D's
    c.run(4)
    assert not c.p.finished_sending, "P freed blocks its write still reads"
    assert not c.d.failed_recving and c.d.engine.stats.settling_loads == 1, "D reported with P's write in flight"
    c.fabric.frozen.discard("D-rank0")
    c.run(4)
    assert c.p.finished_sending == {"r1"} and c.d.finished_recving == {"d1"} and not c.d.failed_recving
    assert np.array_equal(c.d.block(5), c.p.block(1))


def test_push_write_to_a_dead_decoder_frees_p_once_the_write_failed():
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("D-rank0")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    c.clock.advance(11)
    c.fabric.dead.add("D-rank0")  # its process is gone: the write fails, nothing more can land
    c.run(2, nodes=(c.p,))
    assert c.p.finished_sending == {"r1"} and c.p.engine.stats.push_failures == 1


def test_push_write_to_a_frozen_decoder_where_release_aborts():
    c = Cluster(d_extra={"mode": "push"}, aborting=True)
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("D-rank0")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    c.clock.advance(11)
    c.run(2)
    assert c.p.finished_sending == {"r1"} and c.p.engine.stats.push_failures == 1
    assert c.d.failed_recving == {"d1"}  # P's failure notice (it settled at once) ends it


def test_handshake_with_a_frozen_producer_fails_at_its_deadline():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add(f"127.0.0.1:{P_PORT}")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    assert not c.d.finished_recving
    c.clock.advance(13)  # past D's handshake (2 s) + transfer (10 s) deadlines
    c.run(2)
    assert c.d.failed_recving == {"d1"}


def _push_to_a_stalled_p() -> Cluster:
    """D (hand-shaken) asks P to push; P's side channel stops answering; D's deadline passes."""
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r0", (8,))
    Cluster.recv(c.d, "d0", "r0", (9,), (8,))  # hand-shaken
    c.run()
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add(f"127.0.0.1:{P_PORT}")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3)
    c.clock.advance(13)
    c.run(2)
    return c


def test_push_request_unanswered_fails_at_the_deadline():
    """The push request may have reached a stalled P: D aborts it and reports the load failed only
    once P confirms (here when P's side channel answers again), never on its own clock."""
    c = _push_to_a_stalled_p()
    assert not c.d.failed_recving and c.d.engine.stats.settling_loads == 1
    c.clock.advance(3)  # the abort's own deadline: asked again
    c.fabric.frozen.discard(f"127.0.0.1:{P_PORT}")
    c.run(3, dt=0.06)
    assert c.d.failed_recving == {"d1"}
    assert any(isinstance(m, wire.AbortPush) for m in c.fabric.requests)


def test_push_request_to_a_producer_that_is_gone_fails_once_nothing_listens_there():
    c = _push_to_a_stalled_p()
    assert not c.d.failed_recving
    c.fabric.dead.add(f"127.0.0.1:{P_PORT}")  # P's process is gone: its socket refuses, its writes died with it
    c.clock.advance(3)
    c.run(3, dt=0.06, nodes=(c.d,))
    assert c.d.failed_recving == {"d1"}


def test_dead_producer_fails_the_read_and_the_next_request_hand_shakes_again():
    c = Cluster()
    c.prefill_done("r0", (8,))
    Cluster.recv(c.d, "d0", "r0", (9,), (8,))
    c.run()
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.dead.add("P-rank0")  # the transport connection breaks
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.failed_recving == {"d1"}
    handshakes = sum(isinstance(m, wire.HandshakeRequest) for m in c.fabric.requests)
    c.fabric.dead.discard("P-rank0")
    c.prefill_done("r2", P_BLOCKS)
    Cluster.recv(c.d, "d2", "r2", D_BLOCKS, P_BLOCKS)
    c.run()
    assert "d2" in c.d.finished_recving and "d2" not in c.d.failed_recving and _loaded(c)
    assert sum(isinstance(m, wire.HandshakeRequest) for m in c.fabric.requests) == handshakes + 1


def test_restarted_producer_refuses_claims_made_with_the_old_handshake():
    c = Cluster(d_extra=CLAIM_ONLY)
    c.prefill_done("r0", (8,))
    Cluster.recv(c.d, "d0", "r0", (9,), (8,))
    c.run()
    c.p.engine.parts.sender.epoch = "restarted"  # what a new process on the same address would say
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.failed_recving == {"d1"}
    assert PEER not in c.d.engine.parts.receiver.producers._peers  # forgotten: the next request hand-shakes anew


def test_push_asking_for_more_blocks_than_p_has_is_refused():
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", tuple(range(4)), P_BLOCKS + (4,))  # 4 D blocks, P holds 3
    c.run()
    assert c.d.failed_recving == {"d1"} and c.p.engine.stats.push_failures == 1


def test_host_kv_is_put_on_huge_pages_at_registration_unless_turned_off(monkeypatch):
    """The connector asks for huge pages over every registered host region (NIXL reads 4 KiB pages
    about half as fast), before the transport registers them; host_huge_pages false leaves them."""
    import kv_connectors.assembly

    asked: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(kv_connectors.assembly, "back_with_huge_pages", lambda spans: asked.append(list(spans)) or 0)
    c = Cluster()
    regions = sorted((int(c.p.kv[i].ctypes.data), c.p.kv[i].nbytes) for i in range(len(c.p.kv)))
    assert len(asked) == 2 and sorted(asked[0]) == regions  # P's, then D's
    asked.clear()
    Cluster(p_extra={"host_huge_pages": False}, d_extra={"host_huge_pages": False})
    assert asked == []
