"""P and D with different block sizes over the memory transport: D's load maps the prompt's tokens
through both block tables (with D's own prefix-cache hits skipped) and moves exactly those tokens'
cells, nothing past the prompt: read by D, or written by P (push, and the transfer-id flow where
D does not know P's blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_connectors.plan import TokenRange
from kv_connectors.specs import ProducerAddress, RecvSpec, StepMetadata
from tests.unit.engine.engine_harness import CELL_WORDS, NUM_BLOCKS, P_PORT, Cluster, Node

PEER = ProducerAddress("P", "127.0.0.1", P_PORT)
HEADS = 2
N = 13  # prompt tokens: P's and D's last blocks are partial


def _cell(node: Node, bs: int, block: int, slot: int, head: int) -> np.ndarray:
    return node.kv[:, block, :].reshape(2, HEADS, bs, CELL_WORDS)[:, head, slot].copy()


def _table(n_tokens: int, bs: int, start: int) -> tuple[int, ...]:
    return tuple(range(start, start + -(-n_tokens // bs)))


@pytest.mark.parametrize("mode", ["pull", "push", "transfer-id"])
@pytest.mark.parametrize(("p_block", "d_block", "cached"), [(4, 8, 0), (8, 4, 0), (4, 8, 8), (8, 4, 4), (4, 6, 6)])
def test_tokens_map_between_block_sizes(p_block: int, d_block: int, cached: int, mode: str):
    """D reads (pull), or P writes (push: P maps the tokens D names; transfer-id: without P's block
    ids on D's side), exactly the prompt's tokens D lacks."""
    c = Cluster(heads=HEADS, p_block=p_block, d_block=d_block, d_extra={"mode": "push" if mode == "push" else "pull"})
    c.p.kv[:] = np.arange(c.p.kv.size, dtype=np.float32).reshape(c.p.kv.shape)  # every word distinct
    p_ids = _table(N, p_block, 1)
    c.prefill_done("r1", p_ids)
    before = c.d.kv.copy()
    local = _table(N - cached, d_block, 7)  # D's blocks for the tokens it does not have
    start = cached // p_block
    spec = RecvSpec(
        PEER,
        "r1",
        local,
        () if mode == "transfer-id" else p_ids[start:],
        tokens=TokenRange(cached, N - cached, src_start=start * p_block, dst_start=cached),
    )
    c.d.step(StepMetadata(reqs_to_recv={"d1": spec}))
    c.run()
    assert c.d.finished_recving == {"d1"} and not c.d.failed_recving
    assert c.p.finished_sending == {"r1"}
    touched = np.zeros(c.d.kv.shape[:2] + (HEADS, d_block), dtype=bool)
    for t in range(cached, N):
        pb, ps = divmod(t, p_block)
        db, ds = divmod(t - cached, d_block)
        for h in range(HEADS):
            assert np.array_equal(_cell(c.d, d_block, local[db], ds, h), _cell(c.p, p_block, p_ids[pb], ps, h)), (t, h)
            touched[:, local[db], h, ds] = True
    untouched = ~np.repeat(touched.reshape(2, NUM_BLOCKS, -1), CELL_WORDS, axis=2)
    assert np.array_equal(c.d.kv[untouched], before[untouched]), "bytes beyond the prompt's tokens were written"
