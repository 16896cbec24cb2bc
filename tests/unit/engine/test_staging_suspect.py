"""Staging with a stopped peer (issue 26, item 4): the slots a responder holds for one peer are capped,
a peer whose liveness probe outlives its deadline (or that owes us a message and stays silent while
its memory still answers probes, as over cma or RDMA) is suspect: nothing new is granted to it, its
queued chunks are refused, it no longer keeps the engine busy, and the slots it holds are
quarantined (never handed to another peer: it may still read or write them) until it answers again
(its chunks then complete, bytes verified) or is confirmed gone (then they are freed).

StagedTransports over one MemoryFabric, on a clock the test moves: "p" serves, "d1" and "d2" stage
through it. `fabric.frozen` is a stopped process over TCP (its memory does not answer a probe); a
transport that is merely not progressed is a stopped process over cma or RDMA (its memory does)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kv_connectors.errors import TransferTimeoutError
from kv_connectors.plan import plan_transfer
from kv_connectors.specs import ProducerAddress, RecvSpec, StepMetadata
from kv_connectors.transports.base import XferState
from kv_connectors.transports.memory import MemoryFabric, MemoryTransport, host_layout
from kv_connectors.transports.staging import StagedTransport
from kv_connectors.transports.staging import transport as staging_transport
from kv_connectors.transports.staging.xfer import StagedXfer
from tests.unit.engine import engine_harness
from tests.unit.engine.engine_harness import P_PORT, Cluster, FakeClock, StagedNode

KiB = 1024
BLOCKS = 16  # a block is one 1 KiB chunk
P_SLOTS = 8  # p's cap per peer: 4
D_SLOTS = 16  # a d stages up to 15 chunks at once
PROBE_S = 1.0  # probe deadline: 4 s; silence: 10 s


class Net:
    def __init__(self, delays: dict[str, float] | None = None) -> None:
        self.delays = delays or {}  # an agent's inner ops (its probes too) complete this long after their post
        self.clock = FakeClock()
        self.fabric = MemoryFabric(self.clock)
        self.nodes: dict[str, StagedNode] = {}
        self.stopped: set[str] = set()  # not progressed (a stopped process)
        for i, (name, slots) in enumerate((("p", P_SLOTS), ("d1", D_SLOTS), ("d2", D_SLOTS))):
            self.nodes[name] = self._make(name, slots, seed=i)
        for a in self.nodes:
            for b in self.nodes:
                if a != b:
                    self.nodes[a].t.connect(b, self.nodes[b].t.local_metadata())

    def _make(self, name: str, slots: int, seed: int) -> StagedNode:
        kv = np.random.default_rng(seed).integers(0, 256, BLOCKS * KiB, dtype=np.uint8)
        t = StagedTransport(
            MemoryTransport(name, self.fabric, self.delays.get(name, 0.0)),
            pool_bytes=slots * KiB,
            chunk_bytes=KiB,
            probe_interval_s=PROBE_S,
            clock=self.clock,
        )
        layout = host_layout(kv, num_blocks=BLOCKS, block_size=1, num_regions=1)
        t.register(layout)
        return StagedNode(t, kv, layout)

    def __getitem__(self, name: str) -> StagedTransport:
        return self.nodes[name].t

    def block(self, name: str, b: int) -> np.ndarray:
        return self.nodes[name].kv[b * KiB : (b + 1) * KiB].copy()

    def read(self, d: str, blocks: list[int], into: list[int]) -> StagedXfer:
        return self[d].post_read("p", plan_transfer(self.nodes["p"].layout, blocks, self.nodes[d].layout, into), b"")  # type: ignore[arg-type]

    def write(self, d: str, blocks: list[int], into: list[int]) -> StagedXfer:
        return self[d].post_write("p", plan_transfer(self.nodes[d].layout, blocks, self.nodes["p"].layout, into), b"")  # type: ignore[arg-type]

    def stop(self, name: str, memory_answers: bool = False) -> None:
        self.stopped.add(name)
        if not memory_answers:
            self.fabric.frozen.add(name)

    def resume(self, name: str) -> None:
        self.stopped.discard(name)
        self.fabric.frozen.discard(name)

    def pump(self, rounds: int = 10, dt: float = 0.01) -> None:
        for _ in range(rounds):
            self.clock.advance(dt)
            for name, node in self.nodes.items():
                if name not in self.stopped:
                    node.t.progress()

    def wait(self, seconds: float, step: float = 0.25) -> None:
        """Time passes with everyone not stopped progressing."""
        for _ in range(int(seconds / step)):
            self.pump(1, step)

    def finish(self, d: str, handle: StagedXfer, rounds: int = 200) -> None:
        for _ in range(rounds):
            if self[d].poll(handle) is XferState.DONE:
                self.pump(3)  # the last FREE or SCATTERED reaches its peer
                return
            self.pump(1)
        raise AssertionError(f"{d}'s transfer did not finish: {handle}")

    def stats(self) -> dict[str, int]:
        return self["p"].pool_stats()


def _p_serves_d1(net: Net, n: int) -> StagedXfer:
    """d1 asks p for n chunks (blocks 0..n-1 into its blocks 8..), then stops before reading any."""
    handle = net.read("d1", list(range(n)), list(range(8, 8 + n)))  # STAGEs for every chunk go out at once
    net.stop("d1")
    net.pump(3)
    return handle


# The cap ---------------------------------------------------------------------------------------------
def test_a_stopped_peer_holds_at_most_its_cap_and_the_other_peers_are_served():
    net = Net()
    _p_serves_d1(net, 8)
    stats = net.stats()
    assert stats["slots_in_use"] == P_SLOTS // 2, f"one stopped peer holds {stats['slots_in_use']} of {P_SLOTS} slots"
    assert stats["queued"] == 4, "its further chunks wait for a slot of their own"
    h = net.read("d2", [8, 9, 10, 11, 12, 13], [0, 1, 2, 3, 4, 5])
    net.finish("d2", h)
    assert all(np.array_equal(net.block("d2", i), net.block("p", 8 + i)) for i in range(6))
    assert net.stats()["slots_in_use"] == 4


# The probe's deadline ----------------------------------------------------------------------------------
def test_past_its_probe_deadline_a_stopped_peer_is_suspect_and_no_longer_keeps_p_busy():
    net = Net()
    h = _p_serves_d1(net, 8)
    net.wait(4.0)  # a probe went out after 1 s of silence and hangs (a stopped process's memory over TCP)
    assert net["p"].busy() and net.stats()["suspect_peers"] == 0, "suspect before the probe's deadline"
    net.wait(2.0)
    stats = net.stats()
    assert not net["p"].busy(), "p's engine never idles: its staging layer stays busy for the stopped peer"
    assert stats["suspect_peers"] == 1 and stats["quarantined_slots"] == 4 and stats["quarantined_bytes"] == 4 * KiB
    assert stats["slots_in_use"] == 4 and stats["queued"] == 0, "held slots stay out of the pool; queued chunks are refused"
    net.resume("d1")  # it answers again: the chunks it was served land, the refused ones fail its transfer (typed)
    net.pump(20)
    with pytest.raises(TransferTimeoutError):
        net["d1"].poll(h)
    assert all(np.array_equal(net.block("d1", 8 + i), net.block("p", i)) for i in range(4)), "a served chunk landed wrong"
    stats = net.stats()
    assert [stats[k] for k in ("slots_in_use", "queued", "quarantined_slots", "quarantined_bytes", "suspect_peers")] == [0] * 5
    assert not net["p"].busy()


def test_a_silent_peer_whose_memory_still_answers_probes_is_suspect_too():
    """Over cma or RDMA a stopped process's memory serves the 1-byte probe: silence decides."""
    net = Net()
    handle = net.read("d1", [0, 1], [8, 9])
    net.stop("d1", memory_answers=True)
    net.pump(3)
    assert net.stats()["slots_in_use"] == 2
    net.wait(8.0)
    assert net["p"].busy() and net.stats()["suspect_peers"] == 0, "its probes answer: not suspect yet"
    net.wait(3.0)
    assert not net["p"].busy() and net.stats()["suspect_peers"] == 1 and net.stats()["quarantined_slots"] == 2
    net.resume("d1")
    net.finish("d1", handle)
    assert all(np.array_equal(net.block("d1", 8 + i), net.block("p", i)) for i in range(2))
    assert net.stats()["suspect_peers"] == 0 and net.stats()["slots_in_use"] == 0


def test_a_peer_we_only_queue_for_is_not_suspect():
    """A transfer of ours still waiting for one of our own slots owes its peer nothing: that peer's
    silence is not held against it (else a full pool would make suspects of idle peers)."""
    net = Net()
    d2 = net["d2"]
    t1 = net.read("d2", list(range(15)), list(range(15)))  # all of d2's own slots, waiting on p ...
    net.stop("p", memory_answers=True)  # ... which stops (its memory still answers probes)
    layouts = net.nodes
    t2 = d2.post_read("d1", plan_transfer(layouts["d1"].layout, [0], layouts["d2"].layout, [15]), b"")  # type: ignore[arg-type]
    net.wait(11.0)
    assert d2.pool_stats()["suspect_peers"] == 1, "p owes d2 its READYs and is suspect; idle d1 owes nothing"
    assert d2.busy(), "the transfer queued for d1 still counts"
    net.resume("p")  # p was not progressed for 11 s: it suspects nobody for time it did not look
    net.pump(2)
    assert net.stats()["suspect_peers"] == 0
    net.finish("d2", t1, rounds=400)
    net.finish("d2", t2)
    assert np.array_equal(net.block("d2", 15), net.block("d1", 0))
    assert d2.pool_stats()["suspect_peers"] == 0


def test_a_suspicion_that_outlives_what_the_peer_owed_does_not_stall_our_next_transfer():
    """A slow link: d1's inner read of p's slot, and its probe of p, take 6 s; p is suspect by then and
    owes d1 nothing once the read landed. d1's next transfer to p still sends its first chunk (one at
    a time while p is suspect): p answers it and is live again."""
    net = Net(delays={"d1": 6.0})
    first = net.read("d1", [0], [8])
    net.wait(5.5)
    assert net["d1"].pool_stats()["suspect_peers"] == 1
    net.finish("d1", first, rounds=200)
    assert net["d1"].pool_stats()["suspect_peers"] == 1, "a finished inner op is not an answer (cma, RDMA)"
    second = net.read("d1", [1, 2], [9, 10])
    net.pump(3)
    assert net["d1"].pool_stats()["suspect_peers"] == 0, "p answered the first chunk"
    for _ in range(100):
        if net["d1"].poll(second) is XferState.DONE:
            break
        net.pump(1, 0.25)
    assert second.state is XferState.DONE
    assert all(np.array_equal(net.block("d1", 8 + i), net.block("p", i)) for i in range(3))


# Quarantine: a suspect peer's slots go to nobody else --------------------------------------------------
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_suspect_peers_slots_go_to_no_other_peer_and_its_chunks_complete_once_it_answers(op: str):
    """A READY slot a stopped D will still read, a granted slot a stopped P will still write: handed to
    another peer, its chunk would be read as the stopped peer's, or overwritten by its late write."""
    net = Net()
    p_before = [net.block("p", b) for b in range(BLOCKS)]
    if op == "read":
        h1 = net.read("d1", [0, 1, 2], [8, 9, 10])
    else:
        h1 = net.write("d1", [0, 1, 2], [8, 9, 10])
    net.stop("d1")
    net.pump(3)
    assert net.stats()["slots_in_use"] == 3
    net.wait(6.0)
    assert net.stats()["suspect_peers"] == 1 and net.stats()["quarantined_slots"] == 3
    for rnd in range(3):  # d2 moves 5 chunks through the 5 other slots, again and again
        if op == "read":
            h2 = net.read("d2", [3 + rnd, 4, 5, 6, 7], [0, 1, 2, 3, 4])
        else:
            h2 = net.write("d2", [3 + rnd, 4, 5, 6, 7], [11, 12, 13, 14, 15])
        net.finish("d2", h2)
        assert net.stats()["slots_in_use"] == 3 and net.stats()["quarantined_slots"] == 3
    net.resume("d1")
    net.finish("d1", h1)
    if op == "read":
        assert all(np.array_equal(net.block("d1", 8 + i), p_before[i]) for i in range(3)), "d1 read another chunk"
        assert all(np.array_equal(net.block("d2", i), p_before[s]) for i, s in enumerate([5, 4, 5, 6, 7]))
    else:
        assert all(np.array_equal(net.block("p", 8 + i), net.block("d1", i)) for i in range(3)), "d1's write landed wrong"
        assert all(np.array_equal(net.block("p", 11 + i), net.block("d2", s)) for i, s in enumerate([5, 4, 5, 6, 7]))
    assert net.stats()["suspect_peers"] == 0 and net.stats()["slots_in_use"] == 0 and net.stats()["quarantined_slots"] == 0


@pytest.mark.parametrize("how", ["dead", "restarted", "disconnected"])
def test_a_suspect_peer_confirmed_gone_frees_its_slots(how: str):
    net = Net()
    _p_serves_d1(net, 8)
    net.wait(6.0)
    assert net.stats()["suspect_peers"] == 1 and net.stats()["quarantined_slots"] == 4
    p = net["p"]
    if how == "dead":  # its connection fails: the hanging probe ends with PeerDisconnectedError
        net.fabric.dead.add("d1")
    elif how == "restarted":  # a new incarnation hand-shakes
        net["d1"].close()
        net.fabric.frozen.discard("d1")
        net.nodes["d1"] = net._make("d1", D_SLOTS, seed=7)
        p.connect("d1", net["d1"].local_metadata())
    else:
        p.disconnect("d1")
    net.pump(3)
    stats = net.stats()
    assert stats["slots_in_use"] == 0 and stats["quarantined_slots"] == 0 and stats["suspect_peers"] == 0 and stats["queued"] == 0
    assert not p.busy()
    h = net.read("d2", list(range(8)), list(range(8)))  # the whole pool serves another peer again
    net.finish("d2", h)
    assert all(np.array_equal(net.block("d2", b), net.block("p", b)) for b in range(8))


# The engine: P idles once the stopped D is suspect ------------------------------------------------------
STAGED = {"staging": "on", "staging_pool_kib": 2, "staging_chunk_kib": 1}  # 2 slots: 1 per peer
P_BLOCKS, D_BLOCKS = (1, 2, 3), (5, 6, 7)


def test_p_idles_once_a_stopped_staged_d_is_suspect_and_the_d_loads_correctly_when_it_resumes(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(engine_harness, "FakeClock", lambda: clock)
    monkeypatch.setattr(staging_transport, "time", types.SimpleNamespace(monotonic=clock))  # staging on the cluster's clock
    c = Cluster(p_extra={**STAGED, "lease_s": 60}, d_extra={**STAGED, "transfer_timeout_s": 60})
    c.prefill_done("r1", P_BLOCKS)
    c.prefill_done("r2", P_BLOCKS)
    c.d.step(StepMetadata(reqs_to_recv={"d1": RecvSpec(ProducerAddress("P", "127.0.0.1", P_PORT), "r1", D_BLOCKS, P_BLOCKS)}))
    staging = c.p.engine.parts.staging
    assert staging is not None
    for _ in range(10):  # until P holds a chunk it gathered for D
        c.run(1, nodes=(c.p,))
        if staging.pool_stats()["slots_in_use"]:
            break
        c.run(1, nodes=(c.d,))
    assert staging.pool_stats()["slots_in_use"] == 1
    c.fabric.frozen.add("D-rank0")  # D stops (SIGSTOP): not stepped, its memory does not answer
    c.run(50, dt=0.02, nodes=(c.p,), idle=True)
    assert not c.p.waits, "P waits while it serves a chunk"
    c.run(300, dt=0.02, nodes=(c.p,), idle=True)  # 6 s in all: past the probe's deadline (1 s of silence + 4 s)
    before = len(c.p.waits)
    c.run(50, dt=0.02, nodes=(c.p,), idle=True)
    assert len(c.p.waits) - before == 50, "P's empty steps do not wait: its staging layer stays busy for the stopped D"
    assert staging.pool_stats()["quarantined_slots"] == 1 and staging.pool_stats()["suspect_peers"] == 1
    d2 = c.add_consumer(extra=STAGED)  # another D loads meanwhile, through P's other slot
    d2.step(StepMetadata(reqs_to_recv={"e1": RecvSpec(ProducerAddress("P", "127.0.0.1", P_PORT), "r2", D_BLOCKS, P_BLOCKS)}))
    c.run(60, nodes=(d2, c.p))
    assert d2.finished_recving == {"e1"} and not d2.failed_recving
    assert all(np.array_equal(d2.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))
    assert staging.pool_stats()["quarantined_slots"] == 1, "the stopped D's slot was handed on"
    c.fabric.frozen.discard("D-rank0")  # D resumes within its deadline: its load completes, from its own chunk
    c.run(60)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    assert all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))
    assert staging.pool_stats()["suspect_peers"] == 0 and staging.pool_stats()["slots_in_use"] == 0
