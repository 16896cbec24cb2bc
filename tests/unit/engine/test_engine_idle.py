"""Empty steps wait for the connector's next event instead of spinning (kv_connectors.idle): the
pacer's backoff, when the engine waits and for how long, and what ends a wait."""

from __future__ import annotations

import threading

from kv_connectors import wire
from kv_connectors.idle import MIN_WAIT_S, IdlePacer
from kv_connectors.specs import StepMetadata
from kv_connectors.worker import POLL_WAIT_S, QUIET_POLL_S
from tests.unit.engine.engine_harness import CLAIM_ONLY, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)


def _approx(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-12 for x, y in zip(a, b))


# the pacer alone ------------------------------------------------------------------------------
def test_the_wait_doubles_per_empty_step_up_to_the_cap_and_resets_after_work():
    waits: list[float] = []
    pacer = IdlePacer(0.001, wait=lambda s: waits.append(s) or False)
    for _ in range(6):
        pacer.pause(float("inf"))
    assert _approx(waits, [0.0001, 0.0002, 0.0004, 0.0008, 0.001, 0.001])
    pacer.reset()
    pacer.pause(float("inf"))
    assert waits[-1] == MIN_WAIT_S
    pacer.pause(0.00015)  # a shorter cap (a transfer in flight) bounds the wait, not the backoff
    assert waits[-1] == 0.00015
    assert pacer.waits == 8


def test_an_answer_on_its_way_is_awaited_up_to_the_cap_whatever_the_backoff():
    waits: list[float] = []
    pacer = IdlePacer(0.002, wait=lambda s: waits.append(s) or False)
    pacer.pause(float("inf"), awaiting=True)
    pacer.pause(POLL_WAIT_S, awaiting=True)
    assert waits == [0.002, POLL_WAIT_S]


def test_a_wake_ends_the_wait_and_restarts_the_backoff():
    pacer = IdlePacer(60.0)  # a real Event: a wait of up to a minute, unless woken
    pacer._next = 30.0
    pacer.arm()
    threading.Timer(0.01, pacer.wake).start()
    assert pacer.pause(float("inf")) is True, "the wake did not end the wait"
    assert pacer._next == MIN_WAIT_S


def test_a_wake_before_the_wait_is_not_lost_but_arm_forgets_older_ones():
    pacer = IdlePacer(60.0)
    pacer.arm()
    pacer.wake()  # e.g. a reply between looking at the state and waiting
    assert pacer.pause(float("inf")) is True
    recorded: list[float] = []
    pacer = IdlePacer(0.001, wait=lambda s: recorded.append(s) or False)
    pacer.wake()
    pacer.arm()  # the engine looks at its state after this: what came before is seen there
    assert pacer.pause(float("inf")) is False and recorded == [MIN_WAIT_S]


def test_zero_never_waits():
    recorded: list[float] = []
    pacer = IdlePacer(0.0, wait=lambda s: recorded.append(s) or False)
    assert not pacer.enabled and pacer.pause(float("inf")) is False and recorded == []


# the engine ------------------------------------------------------------------------------------
def test_p_holding_blocks_waits_between_empty_steps():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    for _ in range(20):
        c.p.step(idle=True)
    assert len(c.p.waits) == 20
    assert c.p.waits[0] == MIN_WAIT_S and max(c.p.waits) == 0.002, "default cap idle_wait_ms=2"
    assert c.p.waits == sorted(c.p.waits), "the wait grows while nothing happens"
    c.p.step()  # a step with tokens: no wait, and the next empty step starts short again
    c.p.step(idle=True)
    assert len(c.p.waits) == 21 and c.p.waits[-1] == MIN_WAIT_S
    assert c.p.engine.stats.idle_steps == 21


def test_steps_with_tokens_or_results_do_not_wait():
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(5)  # steps that schedule tokens
    assert c.d.finished_recving == {"d1"} and not c.d.waits and not c.p.waits
    c2 = Cluster()
    c2.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c2.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c2.d.step(idle=True)  # the read in flight is polled again after a short wait: reported in this step
    assert c2.d.finished_recving == {"d1"} and all(w <= POLL_WAIT_S for w in c2.d.waits)


def test_idle_wait_ms_zero_spins_as_vllm_does():
    c = Cluster(p_extra={"idle_wait_ms": 0})
    c.prefill_done("r1", P_BLOCKS)
    for _ in range(5):
        c.p.step(idle=True)
    assert c.p.waits == []


def test_a_transfer_in_flight_bounds_the_wait_to_the_poll_interval():
    c = Cluster(d_extra={"mode": "push"})
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)  # P has not computed r1: D waits for its write
    for _ in range(30):
        c.d.step(idle=True)
    assert c.d.waits and max(c.d.waits) == POLL_WAIT_S, "P's write is seen only by polling its notification"
    c.prefill_done("r1", P_BLOCKS)
    c.d.step(idle=True)
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving


def test_a_claim_answer_arriving_during_the_wait_is_reported_in_the_same_step():
    c = Cluster(d_extra=CLAIM_ONLY)
    c.prefill_done("r1", P_BLOCKS)
    c.d.client.hold_types = (wire.ClaimRequest,)  # P answers at once, the answer is on its way back
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3, nodes=(c.d,))  # D reads P's blocks and claims P's lease
    assert not c.d.finished_recving
    answered: list[int] = []
    c.d.during_wait = lambda: answered.append(c.d.client.deliver()) or True  # the claim's answer
    c.d.step(idle=True)
    assert answered == [1]
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving, "the load was not reported after the wake"
    assert len(c.d.waits) == 1 and c.d.woken_at_once == 0


def test_d_waits_for_the_claim_answer_up_to_the_cap_once_its_read_is_done():
    c = Cluster(d_extra=CLAIM_ONLY)
    c.prefill_done("r1", P_BLOCKS)
    c.d.client.hold_types = (wire.ClaimRequest,)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(3, nodes=(c.d,))  # the read completes; the claim's answer is on its way
    assert not c.d.engine.parts.receiver.polling() and c.d.engine.parts.receiver.awaiting()
    c.d.step(idle=True)
    assert c.d.waits == [0.002], "the answer wakes D: no need to come back sooner than the cap"


def test_side_channel_answers_and_requests_wake_the_engine():
    c = Cluster(d_extra={"mode": "push"})
    c.prefill_done("r1", P_BLOCKS)
    c.d.client.holding = True
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)  # the handshake reply is held back
    c.d.engine.pacer.arm()
    c.p.engine.pacer.arm()
    assert c.d.client.deliver() >= 1
    assert c.d.engine.pacer.woken, "an answer to D's side-channel request did not wake D"
    c.d.client.holding = False
    c.d.step()  # D sends its push request to P
    assert c.p.engine.pacer.woken, "P's side channel got a push request without waking P"


def test_empty_metadata_is_not_idle_by_default():
    assert StepMetadata().idle is False


# quiet steps ------------------------------------------------------------------------------------
def test_steps_with_nothing_held_or_under_way_skip_the_engine_but_drain_the_transport():
    """Plain decoding: nothing held, nothing loading. The steps skip the engine's work (a
    measurable share of a decode step otherwise), except every QUIET_POLL_S, when whatever a
    peer sent on the transport is read (never left to pile up)."""
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(5)
    assert c.d.finished_recving == {"d1"}
    reads: list[int] = []
    get_notifs = c.d.transport.get_notifs
    c.d.transport.get_notifs = lambda: reads.append(1) or get_notifs()
    before, snapshots = c.d.engine.stats, set()
    for _ in range(100):  # 100 decode steps of 1 ms
        c.clock.advance(0.001)
        c.d.step()
        snapshots.add(id(c.d.engine.stats))
    # a step that does run reads the transport twice (start_load, get_finished); without: 200 reads
    assert 1 <= len(reads) <= 2 * (100 * 0.001 / QUIET_POLL_S + 1), f"{len(reads)} transport reads in 100 quiet steps"
    assert c.d.engine.stats == before and len(snapshots) <= len(reads), "quiet steps took new snapshots of the counters"
    c.p.transport.send_notif(c.d.transport.name, b"from a peer, while D is quiet")
    for _ in range(int(QUIET_POLL_S / 0.001) + 1):
        c.clock.advance(0.001)
        c.d.step()
    assert c.d.transport._inbox == [], "a quiet D left the peer's message in the transport"


def test_a_step_that_brings_work_is_never_skipped():
    c = Cluster()
    c.run(3)  # quiet
    c.prefill_done("r1", P_BLOCKS)  # the lease arrives with the step's metadata
    assert c.p.engine.stats.held_blocks == len(P_BLOCKS)
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run(5)
    assert c.d.finished_recving == {"d1"} and c.p.finished_sending == {"r1"}
    assert c.p.engine.stats.held_blocks == 0
