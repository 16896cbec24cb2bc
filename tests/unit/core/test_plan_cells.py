"""The layout algebra: cells (one token of one KV head) read from registered tensors, and the
planner mapping tokens and heads between any two layouts (tensor-parallel splits, block sizes, CPU,
NHD, HND, MLA). Property test: random pairs of layouts, the runs applied byte for byte move exactly
the cells a numpy reference gather moves, and nothing else."""

from __future__ import annotations

import ctypes
import dataclasses
import random

import numpy as np
import pytest

from kv_connectors.errors import ConfigError, TransferParamsError
from kv_connectors.layout import (
    Cells,
    Part,
    TensorInfo,
    build_layout,
    cells_of_cpu_tensor,
    cells_of_tensor,
    token_major,
)
from kv_connectors.plan import BlockTable, TokenRange, plan_cells
from kv_connectors.tp import rank_heads

LAYERS = 2
HEAD_SIZE = 3  # float32 values per head and token, per K or V


@dataclasses.dataclass
class Side:
    """One rank's KV cache in a given layout, with logical accessors (token slot, local head)."""

    # cpu: vLLM's (blocks, heads, bs, 2*hs): per head K transposed (element d of token s at d * bs + s),
    # then V token by token ("vec" kernels) | fused: the same shape,
    # K and V of a token side by side | nhd (2, blocks, bs, heads, hs) | hnd (2, blocks, heads, bs, hs) | mla
    kind: str
    num_blocks: int
    block_size: int
    first_head: int
    heads: int
    tensors: list[np.ndarray]

    @classmethod
    def make(cls, kind: str, num_blocks: int, block_size: int, first_head: int, heads: int, fill: float) -> Side:
        shape = {
            "cpu": (num_blocks, heads, block_size, 2 * HEAD_SIZE),
            "fused": (num_blocks, heads, block_size, 2 * HEAD_SIZE),
            "nhd": (2, num_blocks, block_size, heads, HEAD_SIZE),
            "hnd": (2, num_blocks, heads, block_size, HEAD_SIZE),
            "mla": (num_blocks, block_size, 2 * HEAD_SIZE),
        }[kind]
        tensors = [np.full(shape, fill, dtype=np.float32) for _ in range(LAYERS)]
        return cls(kind, num_blocks, block_size, first_head, heads, tensors)

    def layout(self):
        infos = [
            TensorInfo(f"layer.{i}", t.ctypes.data, t.shape, tuple(s // t.itemsize for s in t.strides), t.itemsize)
            for i, t in enumerate(self.tensors)
        ]
        layout = build_layout(infos, self.num_blocks, self.block_size, block_dim=1 if self.kind in ("nhd", "hnd") else 0)
        if self.kind == "cpu":
            cells = cells_of_cpu_tensor(infos[0], self.num_blocks, self.block_size, self.heads, HEAD_SIZE, "vec")
        else:
            cells = cells_of_tensor(
                infos[0], self.num_blocks, self.block_size, self.heads, block_dim=1 if self.kind in ("nhd", "hnd") else 0
            )
        return dataclasses.replace(layout, cells=cells.with_first_head(self.first_head))

    def cell(self, layer: int, block: int, slot: int, head: int) -> np.ndarray:
        """A view of one token's K and V values of one (global) head, as (2, HEAD_SIZE)."""
        t, h = self.tensors[layer], head - self.first_head
        if self.kind == "cpu":
            seg = t[block, h].reshape(-1)
            k = seg[slot : HEAD_SIZE * self.block_size : self.block_size]
            v = seg[HEAD_SIZE * self.block_size + slot * HEAD_SIZE :][:HEAD_SIZE]
            return np.stack((k, v))
        if self.kind == "fused":
            return t[block, h, slot].reshape(2, HEAD_SIZE)
        if self.kind == "mla":
            return t[block, slot].reshape(2, HEAD_SIZE)
        if self.kind == "nhd":
            return t[:, block, slot, h]
        return t[:, block, h, slot]

    def set_cell(self, layer: int, block: int, slot: int, head: int, value: np.ndarray) -> None:
        t, h = self.tensors[layer], head - self.first_head
        if self.kind == "cpu":
            seg = t[block, h].reshape(-1)  # a view: t is contiguous
            seg[slot : HEAD_SIZE * self.block_size : self.block_size] = value[0]
            seg[HEAD_SIZE * self.block_size + slot * HEAD_SIZE :][:HEAD_SIZE] = value[1]
        elif self.kind == "fused":
            t[block, h, slot] = value.reshape(-1)
        elif self.kind == "mla":
            t[block, slot] = value.reshape(-1)
        elif self.kind == "nhd":
            t[:, block, slot, h] = value
        else:
            t[:, block, h, slot] = value


def _inside(addr: int, n: int, side: Side) -> bool:
    return any(t.ctypes.data <= addr and addr + n <= t.ctypes.data + t.nbytes for t in side.tensors)


def _apply(plan, src: Side, dst: Side) -> None:
    """Each run copied byte for byte, once checked to lie inside both sides' tensors (a wrong plan
    fails the test, never the interpreter)."""
    for s, d, n in plan.runs():
        assert _inside(s, n, src) and _inside(d, n, dst), f"run {s:#x} -> {d:#x} ({n} bytes) leaves the KV cache"
        ctypes.memmove(d, s, n)


def _random_case(rng: random.Random):
    kinds = rng.choice(
        [("cpu", "cpu"), ("fused", "fused"), ("nhd", "nhd"), ("hnd", "hnd"), ("nhd", "hnd"), ("hnd", "nhd"), ("mla", "mla")]
    )
    total = 1 if kinds[0] == "mla" else rng.choice([1, 2, 4, 8])
    sk, dk = kinds
    tp_s, tp_d = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8])
    if sk == "mla":  # one latent per token, the same on every rank
        (sf, sh), (df, dh) = (0, 1), (0, 1)
    else:
        sf, sh = rank_heads(total, tp_s, rng.randrange(tp_s))
        overlapping = [rank_heads(total, tp_d, r) for r in range(tp_d)]
        df, dh = rng.choice([(f, n) for f, n in overlapping if max(f, sf) < min(f + n, sf + sh)])
    bs_s, bs_d = rng.choice([3, 5, 6, 16]), rng.choice([3, 5, 6, 16])  # never a head count: tokens and heads told apart by size
    n_tokens = rng.randrange(1, 60)
    d_first = rng.randrange(0, n_tokens) // bs_d * bs_d  # D's prefix hit: whole blocks of D's
    first = d_first + rng.randrange(0, n_tokens - d_first)
    count = n_tokens - first
    src = Side.make(sk, 40, bs_s, sf, sh, 0.0)
    dst = Side.make(dk, 40, bs_d, df, dh, -1.0)
    for t in src.tensors:
        t[...] = np.arange(t.size, dtype=np.float32).reshape(t.shape) + 1
    s_ids = rng.sample(range(src.num_blocks), -(-n_tokens // bs_s))
    d_ids = rng.sample(range(dst.num_blocks), -(-(n_tokens - d_first) // bs_d))
    if rng.random() < 0.3:  # consecutive tables coalesce across blocks
        s_ids = list(range(3, 3 + len(s_ids)))
        d_ids = list(range(5, 5 + len(d_ids)))
    return src, dst, BlockTable(s_ids, 0), BlockTable(d_ids, d_first), first, count


@pytest.mark.parametrize("seed", range(300))
def test_runs_move_exactly_the_cells_a_reference_gather_moves(seed: int) -> None:
    rng = random.Random(seed)
    src, dst, s_table, d_table, first, count = _random_case(rng)
    s_layout, d_layout = src.layout(), dst.layout()
    expected = Side(dst.kind, dst.num_blocks, dst.block_size, dst.first_head, dst.heads, [t.copy() for t in dst.tensors])
    lo, hi = max(src.first_head, dst.first_head), min(src.first_head + src.heads, dst.first_head + dst.heads)
    for layer in range(LAYERS):
        for tok in range(first, first + count):
            sb, ss = divmod(tok - s_table.first_token, src.block_size)
            db, ds = divmod(tok - d_table.first_token, dst.block_size)
            for h in range(lo, hi):
                expected.set_cell(layer, d_table.ids[db], ds, h, src.cell(layer, s_table.ids[sb], ss, h))
    plan = plan_cells(s_layout, s_table, d_layout, d_table, first, count)
    _apply(plan, src, dst)
    for got, want in zip(dst.tensors, expected.tensors):
        np.testing.assert_array_equal(got, want)
    assert plan.total_bytes == LAYERS * count * (hi - lo) * 2 * HEAD_SIZE * 4


def test_same_layout_whole_consecutive_blocks_coalesce_to_one_run_per_region():
    src = Side.make("cpu", 16, 8, 0, 2, 0.0)
    dst = Side.make("cpu", 16, 8, 0, 2, 0.0)
    plan = plan_cells(src.layout(), BlockTable([2, 3, 4]), dst.layout(), BlockTable([7, 8, 9]), 0, 24)
    assert plan.num_runs == LAYERS


def test_a_decode_rank_of_tp2_reads_one_contiguous_head_slice_per_block_from_a_tp1_prefill():
    """CPU layout, heads outside tokens: P TP 1 (2 heads) -> D rank 1 of TP 2: one run per block and layer."""
    src = Side.make("cpu", 16, 8, 0, 2, 0.0)
    dst = Side.make("cpu", 16, 8, *rank_heads(2, 2, 1), 0.0)
    plan = plan_cells(src.layout(), BlockTable([2, 3, 4]), dst.layout(), BlockTable([7, 8, 9]), 0, 24)
    assert plan.num_runs == 3 * LAYERS and plan.total_bytes == 3 * 8 * LAYERS * 2 * HEAD_SIZE * 4


def test_block_size_32_to_64_is_two_runs_per_destination_block_and_head():
    src = Side.make("cpu", 16, 32, 0, 2, 0.0)
    dst = Side.make("cpu", 16, 64, 0, 2, 0.0)
    plan = plan_cells(src.layout(), BlockTable([1, 5, 9, 3]), dst.layout(), BlockTable([2, 6]), 0, 128)
    # D blocks x P blocks per D block x heads x (K: a run per transposed row, V: one) x layers
    assert plan.num_runs == 2 * 2 * 2 * (HEAD_SIZE + 1) * LAYERS


def test_cells_of_vllm_layouts():
    cpu = (10, 2, 16, 8)  # vLLM CPU: (blocks, heads, block_size, 2 * head_size), K then V per head
    c = cells_of_cpu_tensor(TensorInfo("l", 0, cpu, (256, 128, 8, 1), 4), 10, 16, 2, 4, "vec")
    assert c == Cells(heads=2, head_stride=512, tokens=16, parts=(Part(0, 4, 64, 4, 4), Part(256, 1, 0, 16, 16)))
    opaque = cells_of_cpu_tensor(TensorInfo("l", 0, cpu, (256, 128, 8, 1), 4), 10, 16, 2, 4, "amx")
    assert not opaque.token_addressable and opaque.head_stride == 512
    with pytest.raises(ConfigError, match="not vLLM's CPU layout"):
        cells_of_cpu_tensor(TensorInfo("l", 0, cpu, (256, 128, 8, 1), 4), 10, 16, 2, 8, "vec")
    c = cells_of_tensor(TensorInfo("l", 0, cpu, (256, 128, 8, 1), 4), 10, 16, 2)  # read as K and V side by side
    assert c == token_major(heads=2, head_stride=512, tokens=16, token_stride=32, cell_bytes=32)
    nhd = (2, 10, 16, 4, 8)  # CUDA NHD: tokens outside heads
    c = cells_of_tensor(TensorInfo("l", 0, nhd, (5120, 512, 32, 8, 1), 2), 10, 16, 4, block_dim=1)
    assert c == token_major(heads=4, head_stride=16, tokens=16, token_stride=64, cell_bytes=16)
    mla = (10, 16, 576)  # MLA: one latent per token, no head dimension
    c = cells_of_tensor(TensorInfo("l", 0, mla, (9216, 576, 1), 2), 10, 16, 1)
    assert c == token_major(heads=1, head_stride=0, tokens=16, token_stride=1152, cell_bytes=1152)
    with pytest.raises(ConfigError, match="cannot tell its token dimension"):
        cells_of_tensor(TensorInfo("l", 0, (10, 16, 16, 8), (2048, 128, 8, 1), 4), 10, 16, 16)


def test_rank_heads_split_and_replicate():
    assert [rank_heads(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ConfigError):
        rank_heads(6, 4, 0)


def test_refusals_name_both_sides():
    a = Side.make("cpu", 16, 8, 0, 1, 0.0)
    b = Side.make("cpu", 16, 8, 1, 1, 0.0)
    with pytest.raises(ConfigError, match="no KV head in common: the source holds heads 0..0, the destination 1..1"):
        plan_cells(a.layout(), BlockTable([1]), b.layout(), BlockTable([2]), 0, 8)
    with pytest.raises(ConfigError, match="KV layouts have 2 and 4 regions"):
        plan_cells(a.layout(), BlockTable([1]), Side.make("nhd", 16, 8, 0, 1, 0.0).layout(), BlockTable([2]), 0, 8)
    other = Side.make("fused", 16, 8, 0, 1, 0.0).layout()
    with pytest.raises(ConfigError, match=r"a token of one head is \(rows, bytes\) \(3, 4, 1, 12\) on the source and \(1, 24\)"):
        plan_cells(a.layout(), BlockTable([1]), other, BlockTable([2]), 0, 8)
    with pytest.raises(TransferParamsError, match="the transfer needs 0..15"):
        plan_cells(a.layout(), BlockTable([1]), a.layout(), BlockTable([2, 3]), 0, 16)
    with pytest.raises(TransferParamsError, match="int64"):
        plan_cells(a.layout(), BlockTable([2**63]), a.layout(), BlockTable([2]), 0, 8)


def test_a_layout_known_only_to_a_heads_block_moves_whole_head_slices_but_no_tokens():
    """vLLM CPU kernels other than "vec" (amx, vec16): the inside of a head's block is not known;
    another TP split still moves whole head slices, a token range or another block size is refused."""
    src, dst = Side.make("cpu", 16, 8, 0, 2, 0.0), Side.make("cpu", 16, 8, 1, 1, 0.0)

    def opaque(side: Side):
        layout = side.layout()
        t = side.tensors[0]
        info = TensorInfo("l", t.ctypes.data, t.shape, tuple(x // 4 for x in t.strides), 4)
        cells = cells_of_cpu_tensor(info, 16, 8, side.heads, HEAD_SIZE, None).with_first_head(side.first_head)
        return dataclasses.replace(layout, cells=cells)

    for t in src.tensors:
        t[...] = np.arange(t.size, dtype=np.float32).reshape(t.shape)
    plan = plan_cells(opaque(src), BlockTable([3, 4]), opaque(dst), BlockTable([5, 6]), 0, 16)
    _apply(plan, src, dst)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(dst.tensors[layer][[5, 6], 0], src.tensors[layer][[3, 4], 1])
    with pytest.raises(ConfigError, match="tokens cannot be mapped"):
        plan_cells(opaque(src), BlockTable([3, 4]), opaque(dst), BlockTable([5, 6]), 0, 13)


def test_a_token_range_is_planned_through_both_block_tables():
    """TokenRange: a load's tokens and where each side's first block begins, one value. Blocks pair one
    to one where both sides' blocks hold as many tokens or no range is given; otherwise its tokens are
    planned as plan_cells plans them through both block tables."""
    src, dst = Side.make("cpu", 16, 32, 0, 2, 0.0).layout(), Side.make("cpu", 16, 64, 0, 2, 0.0).layout()
    tokens = TokenRange(40, 60, src_start=32, dst_start=0)
    assert not tokens.pairs_blocks(src, dst) and TokenRange().pairs_blocks(src, dst) and tokens.pairs_blocks(src, src)
    plan = tokens.plan(src, [5, 9, 3], dst, [2, 6])
    expected = plan_cells(src, BlockTable([5, 9, 3], 32), dst, BlockTable([2, 6], 0), 40, 60)
    assert plan.runs() == expected.runs() and plan.num_blocks == expected.num_blocks
