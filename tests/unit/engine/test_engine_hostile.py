"""Hostile input against the engine (memory transport, fake clock): ids beyond int64 or the peer's
cache, bad layouts, and a fuzz of random and mutated messages. Each gets an error; nothing raises
out of a step, nothing is read or freed that should not be, and the engines keep serving."""

from __future__ import annotations

import random

import msgspec
import numpy as np

from kv_connectors import wire
from kv_connectors.specs import ProducerAddress, RecvSpec, StepMetadata
from tests.unit.engine.engine_harness import D_PORT, P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)


def _serves(c: Cluster, rid: str, p_blocks=(10, 11), d_blocks=(12, 13)) -> None:
    c.prefill_done(rid, p_blocks)
    Cluster.recv(c.d, "d-" + rid, rid, d_blocks, p_blocks)
    c.run()
    assert "d-" + rid in c.d.finished_recving and "d-" + rid not in c.d.failed_recving
    assert all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(p_blocks, d_blocks))


def test_block_ids_beyond_int64_or_the_peers_cache_fail_the_request():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    for i, remote in enumerate([(2**63, 1, 2), (2**64 - 1, 1, 2), (-1, 1, 2), (1, 2, 16), (1, 2, 10**12)]):
        Cluster.recv(c.d, f"bad{i}", "r1", D_BLOCKS, remote)
    c.run()
    assert c.d.failed_recving == {f"bad{i}" for i in range(5)}
    _serves(c, "r2")


def test_push_request_with_ids_beyond_int64_fails_that_push_only():
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", (2**63, 5, 6), P_BLOCKS)  # D's own ids, as P would be told them
    c.run()
    assert c.d.failed_recving == {"d1"}
    assert c.p.engine.stats.push_failures == 1
    assert c.p.finished_sending == {"r1"}, "P kept the blocks of a push that cannot be written"
    c.prefill_done("r2", P_BLOCKS)
    Cluster.recv(c.d, "d2", "r2", D_BLOCKS, P_BLOCKS)
    c.run()
    assert "d2" not in c.d.failed_recving and "d2" in c.d.finished_recving


def test_producer_advertising_an_impossible_layout_is_refused():
    c = Cluster()
    bad = wire.LayoutMsg(16, 4, [wire.RegionMsg(2**63 - 10, 256, 256)])
    real = c.fabric.servers[("127.0.0.1", P_PORT)].handler

    def lying(body):
        reply = real(body)
        if isinstance(reply, wire.HandshakeReply):
            reply = msgspec.structs.replace(reply, layout=bad)
        return reply

    c.fabric.servers[("127.0.0.1", P_PORT)].handler = lying
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.failed_recving == {"d1"}


def _mutations(rng: random.Random, keys: list[str]) -> list[wire.Body]:
    ids = lambda: [rng.choice([0, 1, 15, 16, -1, 2**63 - 1, rng.randrange(100)]) for _ in range(rng.randrange(6))]  # noqa: E731
    key = lambda: rng.choice(keys + ["", "x" * 1000, str(rng.random())])  # noqa: E731
    return [
        wire.ClaimRequest(key(), [wire.ClaimItem(key(), ids()) for _ in range(rng.randrange(4))], epoch=rng.choice(["", "stale"])),
        wire.PushRequest(key(), key(), key(), key(), ids()),
        wire.RenewRequest(key(), [key() for _ in range(3)]),
        wire.HandshakeRequest(key(), rng.randrange(4), msgspec.structs.replace(c_compat, num_layers=rng.choice([1, 2]))),
        wire.StatsRequest(),
        wire.TransferDone(key(), key(), rng.choice(["", "boom"])),
    ]


def test_fuzzed_side_channel_and_notifications_leave_both_engines_serving():
    global c_compat
    c = Cluster()
    c_compat = c.p.engine.parts.compat
    _serves(c, "before-fuzz")  # hand-shaken: D's transport reaches P's
    c.prefill_done("held", P_BLOCKS)  # a lease a fuzzer must not free or read
    rng = random.Random(7)
    keys = ["held", "r9"]
    server = c.fabric.servers[("127.0.0.1", P_PORT)]
    d_server = c.fabric.servers[("127.0.0.1", D_PORT)]
    for n in range(3000):
        body = rng.choice(_mutations(rng, keys))
        frame = wire.encode(body, c_compat.hash())
        if n % 3 == 0:  # mutated bytes
            frame = bytearray(frame)
            for _ in range(rng.randrange(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            frame = bytes(frame)
        if n % 7 == 0:
            frame = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        for srv in (server, d_server):
            wire.decode(srv.answer(frame), None)  # always an answer, never an exception
        if n % 5 == 0:  # garbage notifications through the transport
            c.d.transport.send_notif(c.p.transport.name, frame)
        if n % 50 == 0:
            c.run(1, dt=0.01)
    c.run(3)
    leases = c.p.engine.parts.sender.leases
    assert len(leases._early) <= 100_000 and len(leases._gone) <= 100_000
    # Nothing a fuzzer sent without our hash touched the held lease: D can still read it.
    held_free = "held" in c.p.finished_sending
    if not held_free:
        Cluster.recv(c.d, "d-held", "held", D_BLOCKS, P_BLOCKS)
        c.run()
        assert "d-held" in c.d.finished_recving
    _serves(c, "after-fuzz")
    c.clock.advance(60)
    c.run(2)
    assert c.p.engine.stats.held_blocks == 0


def test_producers_named_by_failed_requests_are_forgotten():
    """Producer addresses come from requests: 500 requests naming 500 side channels nobody listens on
    leave no entry (nor a side-channel thread) behind once they failed."""
    c = Cluster()
    for i in range(500):
        peer = ProducerAddress(f"E{i}", "10.0.0.1", 20000 + i)
        c.d.step(StepMetadata(reqs_to_recv={f"d{i}": RecvSpec(peer, "x", (5,), (1,), remote_tp_size=1)}))
    c.run(5)
    assert len(c.d.failed_recving) == 500
    rx = c.d.engine.parts.receiver.producers
    assert not rx._peers and not rx._expected
    assert len(c.fabric.forgotten) == 500
