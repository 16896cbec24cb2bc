"""The `Transport` contract (kv_connectors/transports/base.py), asserted on every transport kind.

Kinds: memory, staged-memory, nixl, mooncake, staged-nixl, staged-mooncake (conftest.KINDS, with
what each may do differently). P's KV cache is the "staged" profile (16 KiB blocks over packed,
K/V-split and padded regions): a byte outside a plan, padding included, must stay as it was.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kv_connectors.errors import KVConnectorError, PeerDisconnectedError, TransportError
from kv_connectors.plan import TransferPlan
from kv_connectors.transports.base import XferState
from kvc_testing.kvbuffers import block_copy, make_kv, storage_digest
from tests.contract.conftest import D_SEED, KNOWN_DEFECTS, P_SEED, Pair
from tests.transports.helpers import pick_blocks, read_until_error

pytestmark = pytest.mark.timeout(120)

N_BLOCKS = 64  # 1 MiB per transfer: 16 chunks through the staged kinds' 4 slots


def kv(seed: int) -> list[np.ndarray]:
    return make_kv(seed, "staged")


def assert_kv_equal(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"{what}: array {i} differs in {int((g != w).sum())} words"


def check_states(pair: Pair, states: list[XferState]) -> None:
    """IN_PROGRESS (any number of times) then DONE, and DONE stays DONE."""
    assert all(s in (XferState.IN_PROGRESS, XferState.DONE) for s in states), states
    assert states[-1] is XferState.DONE and XferState.DONE not in states[:-1], states
    if pair.caps.first_poll_in_progress:
        assert states[0] is XferState.IN_PROGRESS, f"{pair.caps.kind}: a fresh transfer was DONE at its first poll"


def test_register_metadata_connect_disconnect(pair: Pair) -> None:
    """A registered transport describes itself (the same bytes each time); connecting a known peer
    again is harmless; a disconnected peer cannot be posted to until connected again; disconnecting
    an unknown name is ignored."""
    t, p = pair.t, pair.p
    md = t.local_metadata()
    assert isinstance(md, bytes) and md and t.local_metadata() == md
    assert isinstance(t.name, str) and t.name
    t.connect(p.name, p.metadata)  # the same incarnation again
    plan = pair.read_plan([3, 4], [7, 8])
    pair.poll_states(h := t.post_read(p.name, plan, b""))
    t.release(h)
    t.disconnect(p.name)
    t.disconnect("nobody")
    with pytest.raises(TransportError):
        t.post_read(p.name, plan, b"")
    t.connect(p.name, p.metadata)
    expected = kv(D_SEED)
    block_copy(expected, kv(P_SEED), [3, 4], [7, 8])
    pair.poll_states(h := t.post_read(p.name, plan, b""))
    t.release(h)
    assert_kv_equal(pair.d.storage, expected, "after reconnecting")


def test_read_moves_exactly_the_plan_and_notifies_after_the_bytes(pair: Pair) -> None:
    """post_read: D's planned blocks hold P's, every other D byte (padding too) is untouched, P's
    KV is unchanged; poll goes IN_PROGRESS -> DONE; P gets the notification only once D's bytes
    are in place."""
    t, p = pair.t, pair.p
    src_ids, dst_ids = pick_blocks(seed=3, n=N_BLOCKS)
    expected = kv(D_SEED)
    block_copy(expected, kv(P_SEED), src_ids, dst_ids)
    handle = t.post_read(p.name, pair.read_plan(src_ids, dst_ids), b"read-done")
    states: list[XferState] = []
    at_notif: list[np.ndarray] | None = None
    deadline = time.monotonic() + pair.caps.wait_s
    while at_notif is None or states[-1] is not XferState.DONE:
        assert time.monotonic() < deadline, f"read not done / notified in time: {states[-3:]}, notif {at_notif is not None}"
        if not states or states[-1] is XferState.IN_PROGRESS:
            states.append(t.poll(handle))
        pair.pump()
        if at_notif is None:
            p.inbox += p.call("notifs")
            if any(item[:2] == (t.name, b"read-done") for item in p.inbox):
                at_notif = [a.copy() for a in pair.d.storage]  # what D held when P was told
        time.sleep(0.0005)
    assert t.poll(handle) is XferState.DONE  # DONE stays DONE until released
    t.release(handle)
    check_states(pair, states)
    assert_kv_equal(at_notif, expected, "D when P got the notification")
    assert_kv_equal(pair.d.storage, expected, "D after the read")
    assert_kv_equal(pair.p_dump(), kv(P_SEED), "P (the source)")
    pair.wait_slots_free()


def test_write_moves_exactly_the_plan_and_notifies_after_the_bytes(pair: Pair) -> None:
    """post_write: P's planned blocks hold D's, every other P byte is untouched, D's KV is
    unchanged; P's KV was final when the notification reached it."""
    t, p = pair.t, pair.p
    src_ids, dst_ids = pick_blocks(seed=4, n=N_BLOCKS)
    expected = kv(P_SEED)
    block_copy(expected, kv(D_SEED), src_ids, dst_ids)
    handle = t.post_write(p.name, pair.write_plan(src_ids, dst_ids), b"write-done")
    states = pair.poll_states(handle)
    t.release(handle)
    check_states(pair, states)
    assert pair.wait_p_notif(b"write-done") == storage_digest(expected), "P's KV was not final when notified"
    assert_kv_equal(pair.p_dump(), expected, "P after the write")
    assert_kv_equal(pair.d.storage, kv(D_SEED), "D (the source)")
    pair.wait_slots_free()


def test_empty_plan_still_notifies(pair: Pair) -> None:
    t, p = pair.t, pair.p
    for post, msg in ((t.post_read, b"empty-read"), (t.post_write, b"empty-write")):
        handle = post(p.name, pair.read_plan([], []), msg)
        assert pair.poll_states(handle)[-1] is XferState.DONE
        t.release(handle)
        pair.wait_p_notif(msg)
    assert_kv_equal(pair.d.storage, kv(D_SEED), "D")


def test_notifications_both_ways(pair: Pair) -> None:
    """send_notif reaches the peer as (our name, the exact bytes), any bytes; get_notifs returns
    each message once; transfer-protocol messages (staging) never reach the user."""
    t, p = pair.t, pair.p
    msgs = [b"hello", bytes(range(256)), b"\x00" * 3]
    for m in msgs:
        t.send_notif(p.name, m)
    for m in msgs:
        pair.wait_p_notif(m)
    assert p.call("notify", t.name, b"from-p") == "ok"
    pair.wait_d_notif(b"from-p")
    pair.pump()
    assert pair.notifs == [], pair.notifs  # nothing else, nothing twice
    p.inbox += p.call("notifs")
    assert p.inbox == [], p.inbox


def test_release_in_flight_and_finished(pair: Pair) -> None:
    """release never raises (also twice); a transfer released before it finished polls as a
    TransportError (the handle is forgotten: its bytes may still land, see test_settled_*); after
    releases the pair still moves exact bytes (and staging frees every slot)."""
    t, p = pair.t, pair.p
    src_ids, dst_ids = pick_blocks(seed=5, n=N_BLOCKS)
    plan = pair.read_plan(src_ids, dst_ids)
    in_flight = t.post_read(p.name, plan, b"")
    t.release(in_flight)
    t.release(in_flight)
    if pair.caps.first_poll_in_progress:
        with pytest.raises(TransportError):
            t.poll(in_flight)
    else:  # post may have finished the copy (NIXL inline; Mooncake's thread): DONE, or the release's error
        try:
            assert t.poll(in_flight) is XferState.DONE
        except TransportError:
            pass
    finished = t.post_read(p.name, plan, b"")
    pair.poll_states(finished)
    t.release(finished)
    t.release(finished)
    pair.wait_slots_free()
    expected = kv(D_SEED)
    block_copy(expected, kv(P_SEED), src_ids, dst_ids)
    pair.poll_states(again := t.post_read(p.name, plan, b"again"))
    t.release(again)
    assert_kv_equal(pair.d.storage, expected, "D after a read following the releases")
    pair.wait_p_notif(b"again")
    pair.wait_slots_free()


def test_settled_after_an_abort_means_nothing_more_lands(pair: Pair) -> None:
    """abort() stops what the engine can stop; the transfer is over only once settled() says so
    (it may have completed all the same), and from then on its destination never changes again.
    A completed transfer is settled."""
    t, p = pair.t, pair.p
    src_ids, dst_ids = pick_blocks(seed=6, n=N_BLOCKS)
    plan = pair.read_plan(src_ids, dst_ids)
    done = t.post_read(p.name, plan, b"")
    pair.poll_states(done)
    assert t.settled(done)
    t.release(done)
    handle = t.post_read(p.name, plan, b"")
    t.abort(handle)
    t.abort(handle)  # idempotent
    deadline = time.monotonic() + pair.caps.wait_s
    while not t.settled(handle):
        assert time.monotonic() < deadline, f"{pair.caps.kind}: an aborted transfer never settled"
        pair.pump()
        time.sleep(0.001)
    seen = [a.copy() for a in pair.d.storage]
    for _ in range(20):
        pair.pump()
        time.sleep(0.002)
    assert all(np.array_equal(a, b) for a, b in zip(seen, pair.d.storage)), "bytes landed after settled()"
    t.release(handle)
    pair.wait_slots_free()


def _with_bad_run(plan: TransferPlan, src_shift: int, dst_shift: int) -> TransferPlan:
    """plan plus one run far outside the registered regions (shifted on one side): valid runs first."""
    return TransferPlan(
        np.append(plan.src, plan.src[0] + src_shift),
        np.append(plan.dst, plan.dst[0] + dst_shift),
        np.append(plan.length, plan.length[0]),
        plan.num_runs + 1,
    )


def _refused(pair: Pair, post: object, plan: TransferPlan, at: str) -> TransportError:
    """The TransportError a bad plan gets: from post where at == "post", else from poll."""
    t, p = pair.t, pair.p
    if at == "post":
        with pytest.raises(TransportError) as err:
            post(p.name, plan, b"bad")  # type: ignore[operator]
        return err.value
    handle = post(p.name, plan, b"bad")  # type: ignore[operator]
    try:
        with pytest.raises(TransportError) as err:
            pair.poll_states(handle)
    finally:
        t.release(handle)
    return err.value


@pytest.mark.parametrize("side", ["ours", "peer's"])
def test_plan_outside_registered_regions_is_refused(pair: Pair, side: str, request: pytest.FixtureRequest) -> None:
    """A plan with a run outside the registered regions (ours: at post, always; the peer's: where
    caps.remote_refused_at says) fails with a TransportError (not PeerDisconnectedError), no crash,
    nothing moved on either side (the bad run comes after valid ones), no notification; the pair
    still works afterwards."""
    if side == "peer's" and "partial-remote-refusal" in pair.caps.known_defects:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=KNOWN_DEFECTS["partial-remote-refusal"]))
    t = pair.t
    far = 1 << 40
    read = pair.read_plan([1, 2, 3], [10, 11, 12])
    write = pair.write_plan([1, 2, 3], [10, 11, 12])
    if side == "ours":
        cases = [(t.post_read, _with_bad_run(read, 0, far)), (t.post_write, _with_bad_run(write, far, 0))]
        at = "post"
    else:
        cases = [(t.post_read, _with_bad_run(read, far, 0)), (t.post_write, _with_bad_run(write, 0, far))]
        at = pair.caps.remote_refused_at
    for post, plan in cases:
        err = _refused(pair, post, plan, at)
        assert isinstance(err, KVConnectorError) and not isinstance(err, PeerDisconnectedError), repr(err)
    pair.wait_slots_free()
    assert_kv_equal(pair.d.storage, kv(D_SEED), "D after refused plans")
    assert_kv_equal(pair.p_dump(), kv(P_SEED), "P after refused plans")
    pair.poll_states(h := t.post_read(pair.p.name, read, b"fine"))
    t.release(h)
    pair.wait_p_notif(b"fine")
    pair.p.inbox += pair.p.call("notifs")
    assert all(m != b"bad" for _, m, _ in pair.p.inbox), pair.p.inbox


def test_unknown_peer_is_a_typed_error(pair: Pair) -> None:
    """Posting to, or notifying, a peer never connected raises TransportError; so does connecting
    with metadata that is not this transport's."""
    t = pair.t
    plan = pair.read_plan([0], [0])
    for call in (
        lambda: t.post_read("nobody", plan, b""),
        lambda: t.post_write("nobody", pair.write_plan([0], [0]), b""),
        lambda: t.send_notif("nobody", b"x"),
        lambda: t.connect("stranger", b"not metadata of any transport"),
    ):
        with pytest.raises(TransportError):
            call()
    pair.poll_states(h := t.post_read(pair.p.name, plan, b""))  # the transport is fine
    t.release(h)


def test_close_is_idempotent(pair: Pair) -> None:
    """close never raises, twice neither; a closed transport refuses posts and notifications."""
    t, p = pair.t, pair.p
    plan = pair.read_plan([0, 1], [2, 3])
    t.close()
    t.close()
    with pytest.raises(TransportError):
        t.post_read(p.name, plan, b"")
    with pytest.raises(TransportError):
        t.send_notif(p.name, b"x")
    assert_kv_equal(pair.d.storage, kv(D_SEED), "D after close")


def test_peer_gone_fails_transfers_in_time(pair: Pair) -> None:
    """P disappears (a peer process is SIGKILLed; an in-process peer closes) with a transfer in
    flight: that transfer (where caps.gone_fails_in_flight; else it may finish) and then every new
    one fail with PeerDisconnectedError within caps.gone_deadline_s, never hang."""
    t, p = pair.t, pair.p
    src_ids, dst_ids = pick_blocks(seed=6, n=N_BLOCKS)
    plan = pair.read_plan(src_ids, dst_ids)
    handle = t.post_read(p.name, plan, b"")
    p.kill()
    gone = time.monotonic()
    deadline = gone + pair.caps.gone_deadline_s
    err: TransportError | None = None
    try:
        while t.poll(handle) is XferState.IN_PROGRESS:
            assert time.monotonic() < deadline, f"{pair.caps.kind}: a transfer to a gone peer still runs"
            pair.pump()
            time.sleep(0.001)
    except TransportError as e:
        err = e
    finally:
        t.release(handle)
    if err is None:
        assert not pair.caps.gone_fails_in_flight, f"{pair.caps.kind}: the in-flight transfer completed into a gone peer"
        err, _ = read_until_error(t, p.name, plan, deadline)
    assert isinstance(err, PeerDisconnectedError), repr(err)
    assert time.monotonic() - gone < pair.caps.gone_deadline_s
    later, _ = read_until_error(t, p.name, plan, time.monotonic() + pair.caps.gone_deadline_s)
    assert isinstance(later, PeerDisconnectedError), repr(later)
