"""A hybrid model's loads (several KV cache groups, kv_connectors.groups) through the engine over the
memory transport: D pushing, and the transfer-id flow, P pairs its blocks with D's group by group, each
from its tail; a push request whose groups P cannot pair fails the write, nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from tests.unit.engine.engine_harness import CELL_WORDS, P_PORT, Cluster

PEER = ProducerAddress("P", "127.0.0.1", P_PORT)
ANY_P = ProducerAddress("", "127.0.0.1", P_PORT)
# P holds a sliding window's 3 blocks and a full group's 4; D needs the window's last 2 and all 4.
P_GROUPS = ((9, 10, 11), (1, 2, 3, 4))
D_GROUPS = ((12, 13), (5, 6, 7, 8))
PAIRS = [(10, 12), (11, 13), (1, 5), (2, 6), (3, 7), (4, 8)]


def _flat(groups) -> tuple[int, ...]:
    return tuple(b for g in groups for b in g)


def _sizes(groups) -> tuple[int, ...]:
    return tuple(len(g) for g in groups)


def _heads(node, block: int, first_head: int) -> dict[int, np.ndarray]:
    """Global head -> that head's words in a block (both regions)."""
    b = node.kv[:, block, :].reshape(2, -1, 4 * CELL_WORDS)
    return {first_head + h: b[:, h].copy() for h in range(b.shape[1])}


def _hybrid_prefill(c: Cluster, key: str) -> None:
    c.p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(_flat(P_GROUPS), key, group_sizes=_sizes(P_GROUPS))}))


@pytest.mark.parametrize("flow", ["push", "transfer-id"])
def test_p_writes_each_group_into_ds_blocks_from_its_tail(flow):
    c = Cluster(d_extra={"mode": "push"})
    d_spec = RecvSpec(
        ANY_P if flow == "transfer-id" else PEER,
        "xfer-1" if flow == "transfer-id" else "p-req",
        _flat(D_GROUPS),
        () if flow == "transfer-id" else (11, 10, 1, 2, 3, 4),  # ignored in push mode: P pairs its own
        group_sizes=_sizes(D_GROUPS),
    )
    if flow == "transfer-id":
        c.d.step(StepMetadata(reqs_to_recv={"d1": d_spec}))  # D asks before P computed
        c.run(3)
        _hybrid_prefill(c, "xfer-1")
    else:
        _hybrid_prefill(c, "p-req")
        c.d.step(StepMetadata(reqs_to_recv={"d1": d_spec}))
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    for p_block, d_block in PAIRS:
        assert np.array_equal(c.d.block(d_block), c.p.block(p_block)), (p_block, d_block)
    assert c.p.finished_sending == {"p-req"} and c.p.engine.stats.pushes == 1


@pytest.mark.parametrize(
    ("d_groups", "why"),
    [
        (((12, 13, 14, 15), (5, 6, 7)), "group 0: the prefill holds 3 blocks, the decode needs 4"),
        (((5, 6, 7, 8, 9, 10),), "names 1 KV cache group(s), the prefill holds 2"),
    ],
    ids=["window-p-dropped", "one-group-request"],
)
def test_a_push_p_cannot_pair_group_by_group_fails_and_writes_nothing(d_groups, why, caplog):
    c = Cluster(d_extra={"mode": "push"})
    _hybrid_prefill(c, "p-req")
    sizes = _sizes(d_groups) if len(d_groups) > 1 else ()
    before = {b: c.d.block(b) for g in d_groups for b in g}
    c.d.step(StepMetadata(reqs_to_recv={"d1": RecvSpec(PEER, "p-req", _flat(d_groups), (), group_sizes=sizes)}))
    c.run()
    assert c.d.failed_recving == {"d1"} and c.p.engine.stats.push_failures == 1
    assert all(np.array_equal(c.d.block(b), v) for b, v in before.items()), "a block was written"
    assert why in caplog.text


def test_p_at_tp2_writes_each_group_into_a_tp1_decode_each_rank_its_head():
    """A hybrid between TP sizes (P 2, D 1), D pushing: each P rank pairs its groups with D's from
    each tail and writes its one KV head into D's blocks; D holds head 0 from P rank 0 and head 1
    from P rank 1 in every paired block of both groups, reported once."""
    c = Cluster(p_tp=2, heads=2, d_extra={"mode": "push"})
    p1 = c.add_rank("kv_producer", 1, 2, fill=1.0)
    p1.kv += 100  # P rank 1's head recognisable
    for p in (c.p, p1):
        p.step(StepMetadata(reqs_to_send={"p-req": SendSpec(_flat(P_GROUPS), "p-req", group_sizes=_sizes(P_GROUPS))}))
    spec = RecvSpec(PEER, "p-req", _flat(D_GROUPS), (), group_sizes=_sizes(D_GROUPS), remote_tp_size=2)
    c.d.step(StepMetadata(reqs_to_recv={"d1": spec}))
    c.run(steps=20, nodes=(c.d, c.p, p1))
    assert c.d.recv_reports == ["d1"] and not c.d.failed_recving
    for p_block, d_block in PAIRS:
        got = _heads(c.d, d_block, 0)
        assert np.array_equal(got[0], _heads(c.p, p_block, 0)[0]), (p_block, d_block, "head 0")
        assert np.array_equal(got[1], _heads(p1, p_block, 1)[1]), (p_block, d_block, "head 1")
    assert c.p.finished_sending == {"p-req"} and p1.finished_sending == {"p-req"}
