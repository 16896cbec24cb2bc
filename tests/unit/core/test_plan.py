"""Planner and layout: coalescing, shuffled ids, partial blocks, layouts derived from tensors."""

import numpy as np
import pytest
import torch

from kv_connectors.errors import ConfigError, TransferParamsError
from kv_connectors.layout import KVLayout, Region, TensorInfo, build_layout
from kv_connectors.plan import blocks_for_tokens, plan_transfer


def _info(t: torch.Tensor, name: str = "t") -> TensorInfo:
    return TensorInfo(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())


def _layout(num_blocks=64, seg=1024, regions=2, base=0x10000):
    return KVLayout(
        num_blocks,
        32,
        tuple(Region(base + i * num_blocks * seg * 2, seg, seg, num_blocks) for i in range(regions)),
    )


def test_sequential_blocks_coalesce_to_one_run_per_region():
    src, dst = _layout(), _layout(base=0x900000)
    plan = plan_transfer(src, list(range(10, 20)), dst, list(range(30, 40)))
    assert plan.num_runs == 2
    assert plan.total_bytes == 10 * 1024 * 2
    (s0, d0, l0), (s1, d1, l1) = plan.runs()
    assert (s0, d0, l0) == (src.regions[0].addr(10), dst.regions[0].addr(30), 10 * 1024)
    assert (s1, d1, l1) == (src.regions[1].addr(10), dst.regions[1].addr(30), 10 * 1024)


def test_shuffled_pairs_are_sorted_before_coalescing():
    src, dst = _layout(), _layout()
    pairs = [(5, 25), (3, 23), (4, 24), (9, 2)]
    plan = plan_transfer(src, [p[0] for p in pairs], dst, [p[1] for p in pairs])
    # (3,23),(4,24),(5,25) merge; (9,2) stands alone -> 2 runs per region.
    assert plan.num_runs == 4
    runs = sorted(plan.runs())
    assert (src.regions[0].addr(3), dst.regions[0].addr(23), 3 * 1024) in runs
    assert (src.regions[0].addr(9), dst.regions[0].addr(2), 1024) in runs


def test_contiguous_on_one_side_only_does_not_merge():
    src, dst = _layout(), _layout()
    plan = plan_transfer(src, [1, 2, 3], dst, [7, 9, 11])
    assert plan.num_runs == 6


def test_random_permutation_moves_every_block_exactly_once():
    rng = np.random.default_rng(0)
    src, dst = _layout(num_blocks=256, regions=3), _layout(num_blocks=256, regions=3, base=1 << 30)
    s = rng.permutation(256)[:100]
    d = rng.permutation(256)[:100]
    plan = plan_transfer(src, s, dst, d)
    assert plan.total_bytes == 100 * 1024 * 3
    covered = {}
    for so, do, ln in plan.runs():
        for k in range(ln // 1024):
            covered[so + k * 1024] = do + k * 1024
    expected = {r_s.addr(int(a)): r_d.addr(int(b)) for r_s, r_d in zip(src.regions, dst.regions) for a, b in zip(s, d)}
    assert covered == expected


def test_strided_blocks_never_merge():
    strided = KVLayout(16, 32, (Region(0, 2048, 1024, 16),))
    plan = plan_transfer(strided, [0, 1, 2], strided, [0, 1, 2])
    assert plan.num_runs == 3


def test_partial_last_block_is_moved_whole():
    assert blocks_for_tokens(1, 32) == 1
    assert blocks_for_tokens(32, 32) == 1
    assert blocks_for_tokens(33, 32) == 2
    src, dst = _layout(), _layout()
    n = blocks_for_tokens(70, 32)
    plan = plan_transfer(src, list(range(n)), dst, list(range(n)))
    assert plan.total_bytes == 3 * 1024 * 2


def test_mismatched_inputs_raise():
    src = _layout()
    with pytest.raises(TransferParamsError):
        plan_transfer(src, [1, 2], src, [1])
    with pytest.raises(TransferParamsError):
        plan_transfer(src, [64], src, [0])
    with pytest.raises(ConfigError):
        plan_transfer(src, [1], _layout(seg=512), [1])


def test_empty_plan():
    src = _layout()
    plan = plan_transfer(src, [], src, [])
    assert plan.num_runs == 0 and plan.total_bytes == 0


def test_split_respects_batch_limit():
    src, dst = _layout(), _layout()
    plan = plan_transfer(src, list(range(0, 40, 2)), dst, list(range(0, 40, 2)))
    parts = plan.split(7)
    assert [p.num_runs for p in parts] == [7, 7, 7, 7, 7, 5]
    assert sum(p.total_bytes for p in parts) == plan.total_bytes


def test_cpu_layout_from_tensors():
    # vLLM CPU layout: (num_blocks, kv_heads, block_size, 2 * head_size), one tensor per layer.
    layers = [torch.zeros(10, 2, 32, 64) for _ in range(3)]
    layout = build_layout([_info(t, f"l{i}") for i, t in enumerate(layers)], 10, 32)
    assert len(layout.regions) == 3
    r = layout.regions[1]
    assert r.base == layers[1].data_ptr()
    assert r.seg_len == r.block_stride == 2 * 32 * 64 * 4
    assert layout.block_bytes == 3 * 2 * 32 * 64 * 4


def test_cuda_style_layout_splits_k_and_v():
    # FlashAttention layout: (2, num_blocks, block_size, kv_heads, head_size): K and V regions.
    t = torch.zeros(2, 12, 16, 2, 8)
    layout = build_layout([_info(t)], 12, 16)
    assert len(layout.regions) == 2
    k, v = layout.regions
    assert v.base - k.base == 12 * 16 * 2 * 8 * 4
    assert k.seg_len == 16 * 2 * 8 * 4
    assert k.addr(3) == t.data_ptr() + 3 * k.block_stride


def test_permuted_view_uses_strides():
    # HND view over NHD storage: logical (blocks, heads, bs, hd) with storage (blocks, bs, heads, hd).
    storage = torch.zeros(8, 16, 2, 32)
    view = storage.permute(0, 2, 1, 3)
    layout = build_layout([_info(view)], 8, 16)
    assert layout.regions[0].seg_len == 16 * 2 * 32 * 4


def test_non_block_contiguous_layout_is_refused():
    t = torch.zeros(2, 10, 4, 8).transpose(0, 1)  # (10, 2, 4, 8): K/V stride larger than block stride
    # blocks dim 0 has stride 32, K/V dim has stride 320: K/V becomes separate regions, fine.
    assert len(build_layout([_info(t)], 10, 4).regions) == 2
    bad = torch.zeros(10, 4, 8)[:, :, :4]  # inner dims not contiguous within a block
    with pytest.raises(ConfigError):
        build_layout([_info(bad)], 10, 4)


def test_dim_equal_to_num_blocks_is_not_taken_for_the_block_dim():
    # CPU layout where 2 * head_size == num_blocks (seen with 128 blocks and head size 64).
    t = torch.zeros(128, 4, 32, 128)
    layout = build_layout([_info(t)], 128, 32)
    assert layout.regions[0].seg_len == 4 * 32 * 128 * 4
    with pytest.raises(ConfigError, match="no dimension"):
        build_layout([_info(t)], 7, 32)
    with pytest.raises(ConfigError, match="not the block dim"):
        build_layout([_info(t)], 128, 32, block_dim=1)
