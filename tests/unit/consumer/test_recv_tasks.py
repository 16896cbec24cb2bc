"""D's receive tasks are typed: a load and a release of the same request are separate tasks (no
id prefix), and a failed task carries a FailReason, not just a string."""

from __future__ import annotations

import pytest

from kv_connectors.consumer.tasks import FailReason, RecvFailure, RecvKind, RecvPhase, RecvTask
from kv_connectors.errors import StaleReadError
from kv_connectors.specs import ProducerAddress, RecvSpec, StepMetadata
from tests.unit.engine.engine_harness import P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
PEER = ProducerAddress("P", "127.0.0.1", P_PORT)


@pytest.fixture
def failures(monkeypatch) -> list[tuple[RecvKind, str, RecvFailure]]:
    """Every task failure, as (kind, request id, failure)."""
    seen: list[tuple[RecvKind, str, RecvFailure]] = []
    fail = RecvTask.fail

    def spy(self: RecvTask, *args, **kwargs) -> None:
        fail(self, *args, **kwargs)
        assert self.error is not None
        seen.append((self.kind, self.request_id, self.error))

    monkeypatch.setattr(RecvTask, "fail", spy)
    return seen


def test_task_key_separates_a_load_from_a_release():
    load = RecvTask("d1", RecvSpec(PEER, "r1", (5,), (1,)), 0.0)
    release = RecvTask("d1", RecvSpec(PEER, "r1", (), (), report=False), 0.0, kind=RecvKind.RELEASE)
    assert load.kind is RecvKind.LOAD and load.key != release.key and load.request_id == release.request_id
    load.fail(FailReason.TIMEOUT, "transfer timed out")
    assert load.phase is RecvPhase.FAILED and load.error == RecvFailure(FailReason.TIMEOUT, "transfer timed out")
    assert str(load.error) == "transfer timed out"


def test_a_failed_load_and_a_release_of_one_request_in_one_step(failures):
    """Bad params (the load fails at once) while P's address is usable (P is told to free)."""
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.d.step(
        StepMetadata(
            reqs_failed={"d1": "remote_block_ids has 2 blocks, the prompt fills 3"},
            reqs_to_recv={"d1": RecvSpec(PEER, "r1", (), (), report=False)},
        )
    )
    c.run()
    assert c.d.failed_recving == {"d1"} and c.d.finished_recving == {"d1"}
    assert c.p.finished_sending == {"r1"} and c.p.engine.stats.expired_leases == 0, "the release did not reach P"
    assert [(k, rid, f.reason) for k, rid, f in failures] == [(RecvKind.LOAD, "d1", FailReason.BAD_PARAMS)]
    assert c.d.engine.stats.recv_failures == 1


def test_failure_reasons(failures):
    c = Cluster()
    c.fabric.dead.add(f"127.0.0.1:{P_PORT}")
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    Cluster.recv(c.d, "d2", "r2", (), (), report=False)
    c.run()
    assert c.d.failed_recving == {"d1"}, "a failed release must not be reported to vLLM"
    reasons = {(k, rid): f.reason for k, rid, f in failures}
    assert reasons == {(RecvKind.LOAD, "d1"): FailReason.HANDSHAKE, (RecvKind.RELEASE, "d2"): FailReason.HANDSHAKE}

    failures.clear()
    c = Cluster()
    c.prefill_done("r1", P_BLOCKS)
    c.clock.advance(6)  # past P's 5 s lease: the claim is refused
    c.p.step()
    Cluster.recv(c.d, "d1", "r1", D_BLOCKS, P_BLOCKS)
    c.run()
    assert c.d.failed_recving == {"d1"}
    assert [(rid, f.reason) for _k, rid, f in failures] == [("d1", FailReason.FENCE)]
    assert "refused a stale read" in failures[0][2].message
    assert isinstance(failures[0][2].cause, StaleReadError), "a fenced read's error is typed as such"


def test_a_settling_task_is_quarantined_once_past_its_deadline():
    from kv_connectors.consumer.tasks import Settle

    settle = Settle(RecvFailure(FailReason.TIMEOUT, "late"), since=0.0, deadline=10.0)
    assert not settle.quarantine_due(10.0) and not settle.quarantined
    assert settle.quarantine_due(10.5) and settle.quarantined
    assert not settle.quarantine_due(11.0), "said twice: the pull and push paths would log it again"
