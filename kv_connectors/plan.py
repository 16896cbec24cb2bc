"""Transfer planner: block ids on two layouts -> the fewest coalesced (src, dst, length) byte runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kv_connectors.errors import ConfigError, TransferParamsError
from kv_connectors.layout import KVLayout


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks holding num_tokens tokens; a partial last block is moved whole."""
    return -(-num_tokens // block_size)


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """Byte runs to move, as three parallel int64 arrays (absolute addresses on each side)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    num_blocks: int

    @property
    def num_runs(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def runs(self) -> list[tuple[int, int, int]]:
        return list(zip(self.src.tolist(), self.dst.tolist(), self.length.tolist()))

    def split(self, max_runs: int) -> list[TransferPlan]:
        """Consecutive sub-plans of at most max_runs runs (for engines with a batch limit)."""
        if self.num_runs <= max_runs:
            return [self]
        return [
            TransferPlan(self.src[i : i + max_runs], self.dst[i : i + max_runs], self.length[i : i + max_runs], 0)
            for i in range(0, self.num_runs, max_runs)
        ]


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Both sides must cut blocks into the same segments (same regions, same segment sizes)."""
    if src.shape_signature() != dst.shape_signature():
        raise ConfigError(f"KV layouts differ: {src.shape_signature()} vs {dst.shape_signature()}")


def _as_ids(ids: Sequence[int], side: str) -> np.ndarray:
    """Block ids as int64; ids that are not integers or do not fit (a peer's or a client's) are a
    TransferParamsError, never an OverflowError escaping into the engine's step."""
    try:
        return np.asarray(ids, dtype=np.int64)
    except (OverflowError, ValueError, TypeError) as e:
        raise TransferParamsError(f"{side} block ids must be integers in int64 range: {e}") from e


def _check_ids(ids: np.ndarray, layout: KVLayout, side: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= layout.num_blocks):
        raise TransferParamsError(f"{side} block id out of range 0..{layout.num_blocks - 1}: {ids.min()}..{ids.max()}")


def plan_transfer(src: KVLayout, src_ids: Sequence[int], dst: KVLayout, dst_ids: Sequence[int]) -> TransferPlan:
    """Pair src_ids[i] with dst_ids[i] and coalesce runs that are contiguous on both sides.

    Pairs are sorted by source id first, so a shuffled block table still coalesces wherever
    both sides are consecutive; order does not matter within one transfer.
    """
    check_compatible(src, dst)
    s = _as_ids(src_ids, "source")
    d = _as_ids(dst_ids, "destination")
    if s.shape != d.shape or s.ndim != 1:
        raise TransferParamsError(f"block id lists differ in length: {s.size} source vs {d.size} destination")
    _check_ids(s, src, "source")
    _check_ids(d, dst, "destination")
    if s.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TransferPlan(empty, empty, empty, 0)
    order = np.lexsort((d, s))
    s, d = s[order], d[order]
    srcs, dsts, lens = [], [], []
    for rs, rd in zip(src.regions, dst.regions):
        # A run may continue only where blocks are packed (stride == segment) on both sides.
        packed = rs.block_stride == rs.seg_len and rd.block_stride == rd.seg_len
        if packed and s.size > 1:
            brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
            starts = np.concatenate(([0], brk))
            counts = np.diff(np.concatenate((starts, [s.size])))
        else:
            starts = np.arange(s.size)
            counts = np.ones(s.size, dtype=np.int64)
        srcs.append(rs.base + s[starts] * rs.block_stride)
        dsts.append(rd.base + d[starts] * rd.block_stride)
        lens.append(counts * rs.seg_len)
    return TransferPlan(np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens).astype(np.int64), int(s.size))
