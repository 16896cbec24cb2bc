"""bench_transport's TP and block-size shapes (no transports): the caches each side holds, the
homogeneous counterpart moving the same bytes, and the token check catching a wrong copy."""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.transport.bench_transport import homogeneous_counterpart, tp_shapes
from kv_connectors.plan import BlockTable, plan_cells
from kvc_testing.kvbuffers import bench_kv, bench_layout, check_tokens


def _args(**kw) -> argparse.Namespace:
    base = {"size_mib": 8, "block_kib": 16, "layers": 2, "kv_heads": 2, "p_tp": 1, "d_tp": 1, "d_rank": 0}
    base |= {"p_block": 0, "d_block": 0}
    return argparse.Namespace(**{**base, **kw})


def _moved_bytes(args: argparse.Namespace) -> int:
    """Bytes the benchmark's plan moves: every token of the heads both sides hold."""
    p, d = tp_shapes(args)
    heads = min(p.first_head + p.heads, d.first_head + d.heads) - max(p.first_head, d.first_head)
    return p.num_blocks * p.block_size * heads * p.layers * 64 * 4


def test_tp_shapes_hold_each_ranks_heads():
    p, d = tp_shapes(_args(p_tp=1, d_tp=2, d_rank=1))
    assert (p.heads, p.first_head, d.heads, d.first_head) == (2, 0, 1, 1)
    assert p.block_size == d.block_size and d.size_mib * 2 == p.size_mib
    p, d = tp_shapes(_args(p_tp=2, d_tp=1))
    assert (p.heads, p.first_head, d.heads, d.first_head) == (1, 0, 2, 0) and d.size_mib == 2 * p.size_mib
    p, d = tp_shapes(_args(p_block=32, d_block=64))
    assert (p.block_size, d.block_size, d.num_blocks * 2) == (32, 64, p.num_blocks)


def test_homogeneous_counterpart_moves_the_same_bytes_between_alike_ranks():
    for kw in ({"p_tp": 1, "d_tp": 2, "d_rank": 1}, {"p_tp": 2, "d_tp": 1}, {"p_block": 32, "d_block": 64}):
        args = _args(**kw)
        same = homogeneous_counterpart(args)
        p, d = tp_shapes(same)
        assert (p.heads, p.first_head, p.block_size) == (d.heads, d.first_head, d.block_size), kw
        assert _moved_bytes(same) == _moved_bytes(args), kw


def test_check_tokens_accepts_a_planned_copy_and_refuses_a_wrong_one():
    p, d = tp_shapes(_args(size_mib=1, layers=1, p_block=32, d_block=64))
    src, dst = bench_kv(p, fill="pattern"), bench_kv(d, fill="sentinel")
    s_ids, d_ids = np.random.default_rng(0).permutation(p.num_blocks), np.random.default_rng(1).permutation(d.num_blocks)
    tokens = p.num_blocks * p.block_size
    plan = plan_cells(bench_layout(src, p), BlockTable(s_ids), bench_layout(dst, d), BlockTable(d_ids), 0, tokens)
    s_bytes = src[0].numpy().view(np.uint8).reshape(-1)
    d_bytes = dst[0].numpy().view(np.uint8).reshape(-1)
    s0, d0 = src[0].data_ptr(), dst[0].data_ptr()
    for s, t, n in plan.runs():
        d_bytes[t - d0 : t - d0 + n] = s_bytes[s - s0 : s - s0 + n]
    assert check_tokens(dst, d, d_ids, src, p, s_ids) is None
    d_bytes[d_ids[0] * d.block_kib * 1024] ^= 1  # one byte of D's first block
    assert "VERIFY FAILED" in check_tokens(dst, d, d_ids, src, p, s_ids)
