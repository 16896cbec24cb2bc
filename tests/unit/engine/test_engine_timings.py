"""Per-phase timings of a transfer (kv_connectors.counters.Phase), over the memory transport with a
fake clock: each phase measures what it says, and they add up to the load's total."""

from __future__ import annotations

import logging

import pytest

from kv_connectors.counters import Phase
from kv_connectors.specs import ProducerAddress, RecvSpec, StepMetadata
from tests.unit.engine.engine_harness import P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)


def _recv(c: Cluster, queued_s: float) -> None:
    spec = RecvSpec(ProducerAddress("P", "127.0.0.1", P_PORT), "r1", D_BLOCKS, P_BLOCKS, queued_s=queued_s)
    c.d.step(StepMetadata(reqs_to_recv={"d1": spec}))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_phases_of_one_load_add_up(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    c = Cluster(d_extra={"mode": mode}, d_delay_s=0.05)  # D's transport: each transfer takes 50 ms
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(0.2)
    with caplog.at_level(logging.INFO, logger="kv_connectors"):
        _recv(c, queued_s=0.3)
        c.run(40, dt=0.01)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    phases = c.d.engine.take_phase_durations()
    (transfer,) = c.d.engine.take_load_durations()
    one = {phase: values[0] for phase, values in phases.items() if len(values) == 1}
    assert set(one) == set(phases), phases
    assert one[Phase.QUEUE] == 0.3  # from the scheduler, as given
    assert one[Phase.TOTAL] == pytest.approx(one[Phase.HANDSHAKE] + transfer)
    if mode == "pull":
        assert 0.05 - 1e-9 <= one[Phase.READ] <= transfer  # D's 50 ms read, inside the transfer
        assert 0 <= one[Phase.CLAIM] <= transfer
    else:
        assert Phase.CLAIM not in one  # push is fenced on P's side: no claim round trip
        assert 0 < one[Phase.READ] <= transfer + 1e-9  # push request until P's notice (P writes)
    # P: blocks held from the end of the prefill until D's notice.
    (hold,) = c.p.engine.take_phase_durations()[Phase.LEASE_HOLD]
    assert 0.2 <= hold <= 0.2 + 0.4
    assert c.d.engine.take_phase_durations() == {} and c.p.engine.take_phase_durations() == {}  # taken once
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv load request=d1 ")]
    for key in ("bytes=", "blocks=3", "queue_ms=300.000", "handshake_ms=", "read_ms=", "total_ms=", "transfer_ms="):
        assert key in line, line
    pushed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv push request=r1 ")]
    if mode == "pull":
        assert not pushed
    else:  # P's side of the same push: from D's request to the posted write, then to its end
        (push,) = pushed
        fields = dict(f.split("=") for f in push.split()[2:])
        assert fields["rank"] == "0" and int(fields["bytes"]) > 0 and int(fields["descriptors"]) >= 1, push
        assert float(fields["write_ms"]) >= 0 and float(fields["total_ms"]) == pytest.approx(
            float(fields["wait_ms"]) + float(fields["write_ms"]), abs=0.002
        ), push


def test_an_expired_lease_records_its_hold() -> None:
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(6)  # past P's 5 s lease
    c.p.step()
    assert c.p.finished_sending == {"r1"}
    (hold,) = c.p.engine.take_phase_durations()[Phase.LEASE_HOLD]
    assert hold == pytest.approx(6.0)


def test_a_failed_load_records_no_phases() -> None:
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(6)
    c.p.step()
    _recv(c, queued_s=0.1)
    c.run(10, dt=0.01)
    assert c.d.failed_recving == {"d1"}
    assert c.d.engine.take_phase_durations() == {}


def test_a_load_that_waited_on_its_handshake_keeps_the_handshakes_parts(caplog: pytest.LogCaptureFixture) -> None:
    """The handshake's round trip, the wait for D's engine thread and the transport's connect, each
    measured (what a 30 s first-request stall is made of), kept for the load that waited on them only."""
    from kv_connectors.transports.memory import MemoryTransport

    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.prefill_done("r2", (8, 9))
    c.d.client.holding = True  # the handshake's answer comes back when the test says
    connect = c.d.transport.connect

    def slow_connect(name: str, metadata: bytes) -> None:
        c.clock.advance(0.05)  # the transport's connect takes 50 ms
        connect(name, metadata)

    c.d.transport.connect = slow_connect  # type: ignore[method-assign]
    assert isinstance(c.d.transport, MemoryTransport)
    with caplog.at_level(logging.INFO, logger="kv_connectors.consumer"):
        spec = RecvSpec(ProducerAddress("P", "127.0.0.1", P_PORT), "r1", D_BLOCKS, P_BLOCKS, remote_tp_size=1)
        c.d.step(StepMetadata(reqs_to_recv={"d1": spec}))  # P's TP size known: the handshake goes at once
        c.clock.advance(0.3)  # the answer is 300 ms on its way
        assert c.d.client.deliver() == 1
        c.d.client.holding = False
        c.clock.advance(0.1)  # and waits 100 ms for D's engine thread
        c.run(20, dt=0.001)
    assert c.d.finished_recving == {"d1"}
    phases = c.d.engine.take_phase_durations()
    assert phases[Phase.HANDSHAKE_REPLY] == [pytest.approx(0.3)]
    assert phases[Phase.HANDSHAKE_PICKUP] == [pytest.approx(0.1, abs=0.0015)]  # and the run's first 1 ms step
    assert phases[Phase.HANDSHAKE_CONNECT] == [pytest.approx(0.05)]
    assert phases[Phase.HANDSHAKE][0] >= 0.45
    messages = [r.getMessage() for r in caplog.records]
    (line,) = [m for m in messages if m.startswith("connected to producer P ")]
    assert "reply_ms=300.0 pickup_ms=101.0 connect_ms=50.0" in line, line
    (load,) = [m for m in messages if m.startswith("kv load request=d1 ")]
    assert "handshake_reply_ms=300.000" in load and "handshake_connect_ms=50.000" in load, load
    # The next load finds the producer known: no handshake of its own to report.
    Cluster.recv(c.d, "d2", "r2", (10, 11), (8, 9))
    c.run(20, dt=0.001)
    assert "d2" in c.d.finished_recving
    later = c.d.engine.take_phase_durations()
    assert Phase.HANDSHAKE in later and Phase.HANDSHAKE_REPLY not in later, later
