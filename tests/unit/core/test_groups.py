"""KV cache groups (kv_connectors.groups), P's params naming one block list per group, and the
compatibility hash and its diff with groups."""

from __future__ import annotations

import msgspec
import pytest

from kv_connectors.errors import TransferParamsError
from kv_connectors.groups import NULL_BLOCK, CacheGroup, CacheGroups, GroupKind, flatten, pair_tails, split
from kv_connectors.params import parse_remote_prefill, producer_params
from kv_connectors.wire import CompatInfo
from tests.unit.core.wire_samples import COMPAT

SLIDING = CacheGroup(GroupKind.SLIDING, ("l0", "l2"), 32, window=64)
FULL = CacheGroup(GroupKind.FULL, ("l1", "l3"), 32)
HYBRID = CacheGroups((SLIDING, FULL))


def test_p_holds_a_sliding_windows_blocks_without_vllms_nulls_and_a_full_groups_whole():
    assert HYBRID.held([[NULL_BLOCK, NULL_BLOCK, 7, 8], [3, 4, 5, 6]]) == ((7, 8), (3, 4, 5, 6))
    with pytest.raises(ValueError):
        HYBRID.held([[1]])


def test_groups_pair_from_their_tails_side_by_side():
    local, remote, sizes = pair_tails([[11, 12], [21, 22, 23]], [[5, 6, 7], [1, 2, 3, 4]])
    assert local == (11, 12, 21, 22, 23) and remote == (6, 7, 2, 3, 4) and sizes == (2, 3)
    assert pair_tails([[], [9]], [[5], [1]]) == ((9,), (1,), (0, 1))  # a group D holds whole: nothing of it


def test_a_group_p_holds_fewer_blocks_of_than_d_needs_is_refused_naming_it():
    with pytest.raises(TransferParamsError, match="group 0: the prefill holds 1 blocks, the decode needs 2"):
        pair_tails([[11, 12], [21]], [[7], [1]])
    with pytest.raises(TransferParamsError, match="stated 1 KV cache groups, this model has 2"):
        pair_tails([[1], [2]], [[1]])


def test_split_is_flattens_inverse_and_checks_the_sizes():
    flat, sizes = flatten([(1, 2), (3,)])
    assert split(flat, sizes) == [(1, 2), (3,)] and split(flat, ()) == [flat]
    with pytest.raises(TransferParamsError):
        split(flat, (1, 1))


def test_params_name_one_block_list_per_group_for_a_hybrid():
    params = producer_params(block_ids=((7, 8), (3, 4, 5)), engine_id="P", request_id="r", host="h", port=5, num_tokens=90)
    assert params["remote_block_ids"] == [[7, 8], [3, 4, 5]]
    params["do_remote_prefill"] = True
    rp = parse_remote_prefill(params)
    assert rp.remote_block_ids == (7, 8, 3, 4, 5) and rp.remote_group_sizes == (2, 3)
    one = parse_remote_prefill({**params, "remote_block_ids": [[3, 4]]})  # the built-in's shape, one group
    assert one.remote_block_ids == (3, 4) and one.remote_group_sizes == ()


@pytest.mark.parametrize(
    "ids", [[[1], ["x"]], [[]] * 2, [[1]] * 17, [[1], 2]], ids=["not-int", "no-block", "too-many-groups", "mixed"]
)
def test_bad_per_group_block_ids_are_refused(ids):
    params = producer_params(block_ids=[1], engine_id="P", request_id="r", host="h", port=5, num_tokens=9)
    with pytest.raises(TransferParamsError, match="remote_block_ids"):
        parse_remote_prefill({**params, "do_remote_prefill": True, "remote_block_ids": ids})


def _info(**kw) -> CompatInfo:
    return msgspec.structs.replace(COMPAT, **kw)


def test_groups_are_in_the_hash_and_the_diff_names_each_field():
    one = _info()
    assert one.hash() == _info(groups=()).hash() == _info(groups=CacheGroups((FULL,)).signature()).hash()
    hybrid = _info(groups=HYBRID.signature())
    assert hybrid.hash() != one.hash()
    assert one.diff(hybrid) == "KV cache groups: ours=1 peer=2"
    other = _info(groups=CacheGroups((CacheGroup(GroupKind.SLIDING, ("l0",), 32, window=128), FULL)).signature())
    assert hybrid.diff(other) == "KV cache group 0 window: ours=64 peer=128, KV cache group 0 layers: ours=2 peer=1"
