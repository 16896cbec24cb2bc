"""Settle before report: a failed load whose transfer may still move bytes is reported to vLLM only
once no byte of it can land. The memory transport here behaves as the real engines do (a released
read or write runs on and lands when its peer resumes, MemoryFabric.loose); the moment D reports a
request failed, vLLM gives its blocks to another request (`Reuse` writes a marker into them), and
that request's bytes must stay as written whatever lands afterwards. Every path by which D (or P)
gives up on a transfer in flight: D's deadline, a refused claim, a restarted producer, a poll error,
P's deadline, a P that does not step in its margin, a push request P handles late, staging."""

from __future__ import annotations

import concurrent.futures

import numpy as np

from kv_connectors import wire
from kv_connectors.errors import TransportError
from kv_connectors.specs import ProducerAddress, RecvSpec, StepMetadata
from tests.unit.engine.engine_harness import CLAIM_ONLY, P_PORT, Cluster, Node

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)
ANY_P = ProducerAddress("", "127.0.0.1", P_PORT)
MARK = 777.0  # another request's KV, written into the blocks vLLM reused
STAGED = {"staging": "on", "staging_pool_kib": 2, "staging_chunk_kib": 1}


class Reuse:
    """vLLM's side: once D reports a load failed, its blocks belong to another request (a marker)."""

    def __init__(self, node: Node, blocks: dict[str, tuple[int, ...]]) -> None:
        self.node, self.blocks, self.marked = node, blocks, set()
        step = node.step

        def step_then_reuse(*args, **kwargs) -> None:
            step(*args, **kwargs)
            for rid in sorted(node.failed_recving - self.marked):
                node.kv[:, list(self.blocks[rid]), :] = MARK
                self.marked.add(rid)

        node.step = step_then_reuse  # type: ignore[method-assign]

    def intact(self) -> bool:
        return all(np.all(self.node.kv[:, list(self.blocks[rid]), :] == MARK) for rid in self.marked)


def _recv(node: Node, rid: str, spec: RecvSpec) -> None:
    node.step(StepMetadata(reqs_to_recv={rid: spec}))


def _settling(c: Cluster) -> int:
    return c.d.engine.stats.settling_loads


def _drain(c: Cluster, seconds: float = 40.0) -> None:
    """Everything resumes and runs on: whatever was still moving lands now."""
    c.fabric.frozen.clear()
    for _ in range(8):
        c.clock.advance(seconds / 8)
        c.run(3)


def _read_from_a_stopped_p(c: Cluster) -> None:
    """D reads P's blocks over a link that stalls (P stopped) until past D's 10 s deadline."""
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("P-rank0")  # over TCP a stopped P's memory does not answer: the read stalls
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    c.clock.advance(11)  # past D's 10 s transfer deadline


# pull ----------------------------------------------------------------------------------------------
def test_a_read_abandoned_at_ds_deadline_is_reported_only_once_it_ended():
    c = Cluster()
    reuse = Reuse(c.d, {"d1": D_BLOCKS})
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("P-rank0")  # over TCP a stopped P's memory does not answer: the read stalls
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    c.clock.advance(11)  # past D's 10 s transfer deadline
    c.run(3)
    assert not c.d.failed_recving and _settling(c) == 1, "reported failed with its read still moving"
    c.fabric.frozen.discard("P-rank0")  # P resumes: the read lands
    c.run(3)
    assert c.d.failed_recving == {"d1"} and _settling(c) == 0
    _drain(c)
    assert reuse.intact(), "bytes of the abandoned read landed in blocks vLLM had given to another request"


def test_a_read_that_ended_on_a_broken_connection_has_the_next_load_handshake_again():
    """The link to P is cut past D's deadline and comes back: UCX gave up on the connection during
    the cut, so the abandoned read ends with a disconnect and every later read over that connection
    would fail. The settled read tells D so: the next load handshakes again and succeeds (it failed
    once after every cut, the two-host test's flake)."""
    c = Cluster()
    reuse = Reuse(c.d, {"d1": D_BLOCKS, "d2": (8,)})
    _read_from_a_stopped_p(c)
    c.run(3)
    assert not c.d.failed_recving and _settling(c) == 1
    c.fabric.sever("P-rank0")  # the keepalive gave up on the cut link
    c.fabric.frozen.discard("P-rank0")  # the link is back
    c.run(3)
    assert c.d.failed_recving == {"d1"} and _settling(c) == 0
    c.prefill_done("r2", (4,))
    _recv(c.d, "d2", RecvSpec(PEER, "r2", (8,), (4,)))
    c.run(5)
    assert c.d.failed_recving == {"d1"}, "the first load after the link came back failed"
    assert "d2" in c.d.finished_recving
    assert np.array_equal(c.d.block(8), c.p.block(4))
    assert reuse.intact()


def test_a_read_moving_when_the_claim_is_refused_is_reported_only_once_it_ended():
    """No fault at all: P's lease expired, P reused its blocks, and D's claim is refused while its
    one-second read is moving (the everyday case where lease words are off: GPU KV, staging)."""
    c = Cluster(d_extra=CLAIM_ONLY, d_delay_s=1.0)
    reuse = Reuse(c.d, {"d1": D_BLOCKS})
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(6)  # past P's 5 s lease
    c.p.step()
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    assert c.d.engine.stats.stale_reads_refused == 1
    assert not c.d.failed_recving, "reported failed with its read still moving"
    c.clock.advance(1.1)
    c.run(3)
    assert c.d.failed_recving == {"d1"} and c.d.engine.stats.settled_loads == 1
    _drain(c)
    assert reuse.intact(), "the abandoned read landed (another prompt's KV) in blocks vLLM had given to another request"


def test_a_read_from_a_producer_that_restarted_is_reported_only_once_it_ended():
    c = Cluster(d_extra=CLAIM_ONLY)
    reuse = Reuse(c.d, {"d1": D_BLOCKS})
    c.prefill_done("r0", (8,))
    _recv(c.d, "d0", RecvSpec(PEER, "r0", (9,), (8,)))
    c.run()
    c.d.transport.delay_s = 1.0
    c.p.engine.parts.sender.epoch = "restarted"  # a new process answers the claim
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    assert not c.d.failed_recving, "reported failed with its read still moving"
    c.clock.advance(1.1)
    c.run(3)
    assert c.d.failed_recving == {"d1"}
    _drain(c)
    assert reuse.intact()


def test_a_read_whose_poll_failed_is_reported_only_once_its_engine_says_it_ended(monkeypatch):
    """A poll error is not the end of the bytes (Mooncake's timeout error is not): settled() says when."""
    c = Cluster(d_delay_s=1.0)
    reuse = Reuse(c.d, {"d1": D_BLOCKS})
    c.prefill_done("r1", P_BLOCKS)
    poll = c.d.transport.poll
    failed_once: list[bool] = []

    def flaky(handle):
        if not failed_once:
            failed_once.append(True)
            raise TransportError("transient engine error")
        return poll(handle)

    monkeypatch.setattr(c.d.transport, "poll", flaky)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    assert failed_once and not c.d.failed_recving, "reported failed with its read still moving"
    c.clock.advance(1.1)
    c.run(3)
    assert c.d.failed_recving == {"d1"}
    _drain(c)
    assert reuse.intact()


def test_a_read_abandoned_where_release_aborts_is_reported_at_once():
    c = Cluster(aborting=True)
    _read_from_a_stopped_p(c)
    c.run(2)
    assert c.d.failed_recving == {"d1"} and c.d.engine.stats.settled_loads == 0


def test_a_read_that_never_ends_is_quarantined_past_the_settle_deadline():
    c = Cluster(d_extra={"settle_timeout_s": 5})
    _read_from_a_stopped_p(c)
    c.run(2)
    c.clock.advance(6)
    c.run(2)
    stats = c.d.engine.stats
    assert not c.d.failed_recving, "a quarantined load is still never reported before its read ended"
    assert (stats.settling_loads, stats.quarantined_loads) == (1, 1)
    assert stats.quarantined_bytes == len(D_BLOCKS) * c.d.kv[:, 0, :].nbytes
    c.fabric.frozen.discard("P-rank0")
    c.run(3)
    assert c.d.failed_recving == {"d1"} and c.d.engine.stats.quarantined_loads == 0


# push ----------------------------------------------------------------------------------------------
def test_a_write_past_ps_deadline_is_not_reported_failed_while_it_can_still_land():
    """P's write needs 12 s: P's deadline (9 s) and D's (10 s) pass with it in flight. P keeps it
    until it ended, D's abort is answered "not settled"; the write lands whole and counts."""
    c = Cluster(d_extra={"mode": "push"})
    reuse = Reuse(c.d, {"d1": D_BLOCKS})
    c.p.transport.delay_s = 12.0
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    for _ in range(6):
        c.clock.advance(2)
        c.run(3)
        assert not c.d.failed_recving or reuse.intact()
    _drain(c)
    assert reuse.intact(), "P's abandoned write landed in blocks vLLM had given to another request"
    assert "d1" in c.d.finished_recving


def test_a_write_in_flight_when_p_does_not_step_in_its_margin_is_not_reported_failed():
    """The write is posted in time but needs 10.5 s; P is in a forward pass from 8.5 s to 11 s and
    checks nothing; D's 10 s deadline passes. D aborts and waits for P's word instead of its clock."""
    c = Cluster(d_extra={"mode": "push"})
    reuse = Reuse(c.d, {"d1": D_BLOCKS})
    c.p.transport.delay_s = 10.5
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    c.clock.advance(8.5)
    c.run(1)
    c.clock.advance(1.6)  # 10.1 s: only D steps
    c.run(3, nodes=(c.d,))
    assert not c.d.failed_recving, "D gave its blocks back with P's write in flight"
    c.clock.advance(0.9)
    c.run(3)
    _drain(c)
    assert reuse.intact()
    assert c.d.finished_recving == {"d1"}, "the write landed whole: the load counts"


class LateClient:
    """D's side-channel client whose push requests reach P only at deliver() (a P whose side-channel
    thread stalled): D sees no answer, and the request is still on its way."""

    def __init__(self, node: Node) -> None:
        self._submit = node.client.submit
        self.held: list[tuple[tuple, concurrent.futures.Future]] = []
        node.client.submit = self.submit  # type: ignore[method-assign]

    def submit(self, host, port, body, compat_hash, timeout_s):
        if not isinstance(body, wire.PushRequest):
            return self._submit(host, port, body, compat_hash, timeout_s)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.held.append(((host, port, body, compat_hash, timeout_s), future))
        return future

    def deliver(self) -> None:
        held, self.held = self.held, []
        for args, _future in held:
            self._submit(*args)  # D stopped waiting for this answer long ago


def test_a_push_request_p_handles_late_is_never_written():
    c = Cluster(p_extra={"lease_s": 60}, d_extra={"mode": "push"})  # P's lease outlives D's wait
    reuse = Reuse(c.d, {"d1": D_BLOCKS})
    late = LateClient(c.d)
    c.prefill_done("r1", P_BLOCKS)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(3)
    assert late.held, "the push request is on its way"
    c.clock.advance(13)  # past D's deadline for P's answer
    c.run(3)
    assert c.d.failed_recving == {"d1"}, "P confirmed at once: nothing of it in flight, never to be written"
    late.deliver()  # the stalled P's side channel reads it now, a whole timeout after D gave up
    c.run(3)
    _drain(c, 20)
    assert reuse.intact(), "P wrote into blocks D had given up and vLLM had given to another request"
    assert c.p.engine.stats.pushes == 0


def test_an_aborted_layerwise_push_stops_between_layers():
    c = Cluster()
    _recv(c.d, "d1", RecvSpec(ANY_P, "xfer-1", D_BLOCKS, ()))
    c.run(2)
    c.p.transport.delay_s = 5.0
    c.p.engine.before_forward(StepMetadata(reqs_layerwise={"p-req": wire_spec("xfer-1")}))
    c.p.engine.start_load(None)
    c.p.engine.on_layer_saved("layer.0")
    c.clock.advance(11)  # D's deadline: D aborts (P's side channel answers "not settled": layer 0 in flight)
    c.run(2, nodes=(c.d,))
    assert not c.d.failed_recving
    c.p.engine.on_layer_saved("layer.1")  # after the abort: not posted
    c.p.engine.end_of_forward()
    assert c.p.transport.posted == 1, "a layer was written after D aborted the push"
    _drain(c)
    assert c.d.failed_recving == {"d1"} and c.p.engine.stats.pushes == 0


def wire_spec(key: str):
    from kv_connectors.specs import SendSpec

    return SendSpec(P_BLOCKS, key)


# staging ---------------------------------------------------------------------------------------------
def test_a_staged_reads_slot_stays_out_of_the_pool_until_its_inner_read_ended(monkeypatch):
    """The inner pool-to-pool read fails with an error while its bytes can still land (as Mooncake's
    timeout error): the staged load fails, but its slot is not handed to another chunk (whose KV the
    late bytes would become) until the inner read ended."""
    c = Cluster(p_extra=STAGED, d_extra=STAGED)
    c.prefill_done("r0", P_BLOCKS)
    _recv(c.d, "d0", RecvSpec(PEER, "r0", D_BLOCKS, P_BLOCKS))
    c.run(30)
    assert c.d.finished_recving == {"d0"}
    c.prefill_done("r1", P_BLOCKS)
    c.fabric.frozen.add("P-rank0")  # P's slot does not answer: the inner read stalls
    poll = c.d.transport.poll
    calls: list[int] = []

    def flaky(handle):
        calls.append(1)
        if len(calls) == 3:
            raise TransportError("transfer timed out (the engine's own timeout)")
        return poll(handle)

    monkeypatch.setattr(c.d.transport, "poll", flaky)
    _recv(c.d, "d1", RecvSpec(PEER, "r1", D_BLOCKS, P_BLOCKS))
    c.run(30)
    assert len(calls) >= 3 and "d1" in c.d.failed_recving
    staging = c.d.engine.parts.staging
    assert staging is not None and staging.pool_stats()["slots_in_use"] >= 1, "the slot went back with its read moving"
    c.fabric.frozen.discard("P-rank0")  # the late bytes land, in the slot nobody else has
    c.run(30)
    assert staging.pool_stats()["slots_in_use"] == 0, "the slot stays out once its read ended"
