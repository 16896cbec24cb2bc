"""P's leases (kv_connectors/producer/leases.py): blocks held for a D until its notice or the lease
deadline; early notices, transfer-id keys, writes in flight and a lease replaced under its key."""

from kv_connectors.producer.leases import SendLeases


def test_leases_complete_expire_and_early_notices():
    leases = SendLeases()
    leases.add("a", "a", (1, 2, 3), now=0.0, lease_s=10)
    leases.add("b", "b", (4, 5), now=0.0, lease_s=10)
    assert (leases.held_requests, leases.held_blocks) == (2, 5)
    leases.notice("a", now=1.0)
    leases.notice("c", now=1.0)  # before P's worker heard of c
    assert leases.take_finished(2.0) == ({"a"}, set())
    leases.add("c", "c", (6, 7, 8, 9), now=2.0, lease_s=10)
    assert leases.take_finished(3.0) == ({"c"}, set())
    assert leases.take_finished(10.5) == (set(), {"b"})
    assert (leases.held_requests, leases.held_blocks, leases.completed, leases.expired) == (0, 0, 2, 1)


def test_leases_keyed_by_transfer_id_report_request_ids():
    leases = SendLeases()
    leases.notice("xfer-1", now=0.0)  # D released before P computed anything
    leases.add("xfer-1", "req-1", (1,), now=1.0, lease_s=10)
    leases.add("xfer-2", "req-2", (2, 3), now=1.0, lease_s=10)
    assert leases.block_ids("xfer-2") == (2, 3) and leases.block_ids("req-2") is None
    assert leases.take_finished(2.0) == ({"req-1"}, set())
    assert leases.take_finished(20.0) == (set(), {"req-2"})


def test_a_lease_neither_expires_nor_ends_while_a_write_reads_its_blocks():
    writing = {"a"}
    leases = SendLeases(writing=lambda key: key in writing)
    leases.add("a", "a", (1, 2), now=0.0, lease_s=1)
    assert leases.block_ids("a") == (1, 2)
    assert leases.take_finished(100.0) == (set(), set())
    assert leases.notice("a", now=100.0)  # a release, or another reader: ended once the write settles
    assert leases.take_finished(100.0) == (set(), set()) and leases.held_blocks == 2
    writing.clear()
    leases.notice("a", now=101.0)  # the sender's, as the write ends
    assert leases.take_finished(101.0) == ({"a"}, set())


def test_an_early_notice_waits_for_writes_from_the_blocks():
    """Layer-wise push: a D rank's write ended (its notice) before P's lease was added, another
    rank's is in flight: the lease begins released, and ends when that write does."""
    writing = {"t"}
    leases = SendLeases(writing=lambda key: key in writing)
    leases.notice("t", now=0.0, consumer="D#0", engine="D", readers=2)
    leases.add("t", "p-req", (1, 2), now=0.0, lease_s=5)
    assert leases.take_finished(0.0) == (set(), set()) and leases.held_blocks == 2
    writing.clear()
    leases.notice("t", now=1.0, consumer="D#1", engine="D", readers=2)
    assert leases.take_finished(1.0) == ({"p-req"}, set())


def test_a_lease_replaced_under_its_key_is_freed_once_nothing_uses_it():
    """A second prefill under one key (a router reusing a transfer id): the first request's blocks
    are reported finished, after its readers' claims and any write under the key ended."""
    writing = {"t"}
    leases = SendLeases(writing=lambda key: key in writing)
    leases.add("t", "p-a", (1, 2), now=0.0, lease_s=5)
    assert leases.claim("t", "D#0", (1, 2), now=0.0, hold_s=3).result.value == "granted"
    leases.add("t", "p-b", (3, 4), now=1.0, lease_s=5)
    assert leases.take_finished(2.0) == (set(), set()) and leases.held_blocks == 4
    writing.clear()
    assert leases.take_finished(2.0) == (set(), set())  # the claim holds until 3.0
    assert leases.take_finished(3.0) == ({"p-a"}, set()) and leases.held_blocks == 2
    assert leases.take_finished(7.0) == (set(), {"p-b"})
