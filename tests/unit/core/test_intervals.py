"""The shared address-range checks (kv_connectors/transports/intervals.py): boundaries, merging, overflow."""

from __future__ import annotations

import numpy as np
import pytest

from kv_connectors.errors import TransportError
from kv_connectors.transports.intervals import Ranges, merge_ranges, total_bytes

I64 = np.int64
MAX = (1 << 63) - 1


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=I64)


def test_merge_joins_overlaps_keeps_touching_apart_and_drops_empties() -> None:
    spans = [(300, 400), (100, 200), (150, 250), (250, 260), (500, 500), (600, 550), (100, 200)]
    assert merge_ranges(spans) == [(100, 250), (250, 260), (300, 400)]
    assert merge_ranges([]) == []


def test_a_run_ending_exactly_at_the_end_is_inside_one_byte_more_is_not() -> None:
    r = Ranges([(1000, 2000)])
    addr = arr(1000, 1000, 1999, 1999, 1500, 999, 2000)
    length = arr(1000, 1001, 1, 2, 500, 1, 1)
    assert r.inside(addr, length).tolist() == [True, False, True, False, True, False, False]
    assert r.first_outside(addr[:3], length[:3]) == 1
    assert r.first_outside(addr[[0, 2, 4]], length[[0, 2, 4]]) is None


def test_zero_and_negative_lengths_are_refused_everywhere() -> None:
    r = Ranges([(1000, 2000)])
    assert r.inside(arr(1000, 1500, 2000, 1500), arr(0, 0, 0, -1)).tolist() == [False] * 4


def test_a_run_across_two_touching_ranges_is_outside() -> None:
    r = Ranges([(1000, 2000), (2000, 3000)])  # e.g. the K and V halves of one tensor, registered apart
    assert len(r) == 2
    assert r.inside(arr(1500, 2500, 1000, 2000), arr(500, 500, 1001, 1000)).tolist() == [True, True, False, True]


def test_ranges_grow_and_merge_with_what_is_there() -> None:
    r = Ranges()
    assert r.inside(arr(5), arr(1)).tolist() == [False]
    r.add([(0, 10)])
    r.add([(5, 20), (40, 50)])
    assert r.spans == [(0, 20), (40, 50)]
    assert r.inside(arr(0, 15, 40, 20), arr(20, 5, 10, 1)).tolist() == [True, True, True, False]


def test_lengths_near_int64_max_do_not_wrap_into_inside() -> None:
    # addr + length wraps negative in int64; the old `addr + length <= end` took such a run as inside
    r = Ranges([(1 << 40, (1 << 40) + 4096)])
    addr = arr(1 << 40, (1 << 40) + 4095, 1 << 40)
    length = arr(MAX, MAX - 100, 4096)
    assert r.inside(addr, length).tolist() == [False, False, True]
    assert r.inside(arr(-(1 << 62)), arr(1 << 62)).tolist() == [False]  # below every range


def test_total_bytes_is_exact_where_numpy_wraps() -> None:
    length = arr(MAX, MAX, 16)
    assert int(length.sum()) == 14  # numpy wraps: what a peer could use to pass a size check
    assert total_bytes(length) == 2 * MAX + 16
    assert total_bytes(arr()) == 0 and total_bytes(arr(3, 4)) == 7


def test_check_names_the_first_bad_run_and_the_memory() -> None:
    r = Ranges([(0x1000, 0x2000)])
    r.check(arr(), arr(), "nothing")  # no runs: nothing to check
    r.check(arr(0x1000, 0x1800), arr(0x1000, 0x800), "fine")
    with pytest.raises(TransportError, match=r"local side: run 1 \(0x1ff0, 32 bytes\) is not inside registered KV memory"):
        r.check(arr(0x1000, 0x1FF0), arr(16, 32), "local side", "KV memory")
    with pytest.raises(TransportError, match="no KV memory is registered"):
        Ranges().check(arr(0x1000), arr(1), "x", "KV memory")


def test_vectorised_matches_a_plain_loop() -> None:
    rng = np.random.default_rng(7)
    spans = [(int(s), int(s + n)) for s, n in zip(rng.integers(0, 10_000, 40), rng.integers(0, 400, 40))]
    r = Ranges(spans)
    merged = merge_ranges(spans)
    addr = rng.integers(-100, 10_500, 5000)
    length = rng.integers(-5, 600, 5000)
    want = [n > 0 and any(s <= a and a + n <= e for s, e in merged) for a, n in zip(addr.tolist(), length.tolist())]
    assert r.inside(addr, length).tolist() == want
