"""Transfer planner: block ids on two layouts -> the fewest coalesced (src, dst, length) byte runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kv_connectors.errors import ConfigError, TransferParamsError
from kv_connectors.layout import Cells, KVLayout


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


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """One side's blocks of a sequence: ids[i] holds its tokens [first_token + i * block_size, ...)."""

    ids: Sequence[int]
    first_token: int = 0


@dataclasses.dataclass(frozen=True)
class TokenRange:
    """A load's prompt tokens [first, first + count), and the token each side's first block begins
    at (src: P's blocks, dst: D's). count 0: no range; the blocks are paired one to one. Built once
    by the scheduler side; a push request carries it over the wire as its own fields."""

    first: int = 0
    count: int = 0
    src_start: int = 0
    dst_start: int = 0

    def pairs_blocks(self, src: KVLayout, dst: KVLayout) -> bool:
        """Blocks pair one to one (plan_blocks): both sides' blocks hold as many tokens, or no range."""
        return src.block_size == dst.block_size or not self.count

    def plan(self, src: KVLayout, src_ids: Sequence[int], dst: KVLayout, dst_ids: Sequence[int]) -> TransferPlan:
        """The range's tokens, mapped through both sides' block tables (plan_cells)."""
        src_table, dst_table = BlockTable(src_ids, self.src_start), BlockTable(dst_ids, self.dst_start)
        return plan_cells(src, src_table, dst, dst_table, self.first, self.count)


def _cells_of(layout: KVLayout, side: str) -> Cells:
    if layout.cells is None:
        raise ConfigError(f"the {side} KV layout does not describe its tokens and heads: only whole blocks can be planned")
    return layout.cells


def check_cells_compatible(src: KVLayout, dst: KVLayout) -> tuple[int, int]:
    """The heads both sides hold, as (first, count); a ConfigError naming both sides' values where
    tokens cannot be mapped (another number of regions, other parts, no common head)."""
    sc, dc = _cells_of(src, "source"), _cells_of(dst, "destination")
    if len(src.regions) != len(dst.regions):
        raise ConfigError(f"KV layouts have {len(src.regions)} and {len(dst.regions)} regions (layers x K/V)")
    if sc.signature() != dc.signature():
        raise ConfigError(
            f"a token of one head is (rows, bytes) {sc.signature()} on the source and {dc.signature()} on the destination"
        )
    lo, hi = max(sc.first_head, dc.first_head), min(sc.first_head + sc.heads, dc.first_head + dc.heads)
    if hi <= lo:
        raise ConfigError(
            f"no KV head in common: the source holds heads {sc.first_head}..{sc.first_head + sc.heads - 1}, "
            f"the destination {dc.first_head}..{dc.first_head + dc.heads - 1}"
        )
    return lo, hi - lo


def _whole_blocks(table: BlockTable, bs: int, first: int, count: int, n_ids: int) -> bool:
    return first == table.first_token and count == n_ids * bs


def _segments(
    first: int, count: int, src: BlockTable, bs_s: int, dst: BlockTable, bs_d: int, whole: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Token runs [start, start + length) inside one block on both sides (whole=True), or single
    tokens (a token's cells are not next to each other on some side)."""
    t = np.arange(first, first + count, dtype=np.int64)
    if not whole:
        return t, np.ones(count, dtype=np.int64)
    cut = ((t - src.first_token) % bs_s == 0) | ((t - dst.first_token) % bs_d == 0)
    cut[0] = True
    starts = t[cut]
    return starts, np.diff(np.concatenate((starts, [first + count])))


def _table_ids(table: BlockTable, layout: KVLayout, first: int, count: int, side: str) -> np.ndarray:
    ids = _as_ids(table.ids, side)
    _check_ids(ids, layout, side)
    lo, hi = first - table.first_token, first + count - table.first_token
    if lo < 0 or hi > ids.size * layout.block_size:
        raise TransferParamsError(
            f"{side} blocks hold tokens {table.first_token}..{table.first_token + ids.size * layout.block_size - 1}, "
            f"the transfer needs {first}..{first + count - 1}"
        )
    return ids


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs sorted by source address, merged where both sides continue one another."""
    if src.size == 0:
        return src, dst, length
    order = np.argsort(src, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    joins = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def plan_cells(src: KVLayout, src_table: BlockTable, dst: KVLayout, dst_table: BlockTable, first: int, count: int) -> TransferPlan:
    """Tokens [first, first + count) of the heads both sides hold, from src's blocks to dst's:
    the fewest coalesced byte runs between any two layouts (block sizes, head slices of another
    tensor-parallel split, NHD against HND, transposed K). Each (token run inside a block on both
    sides, head, part, row, region) is one run; runs are merged wherever both sides continue."""
    h0, nh = check_cells_compatible(src, dst)
    sc, dc = _cells_of(src, "source"), _cells_of(dst, "destination")
    s_ids = _table_ids(src_table, src, first, count, "source")
    d_ids = _table_ids(dst_table, dst, first, count, "destination")
    empty = np.zeros(0, dtype=np.int64)
    if count <= 0:
        return TransferPlan(empty, empty, empty, 0)
    if not (sc.token_addressable and dc.token_addressable) and not (
        src.block_size == dst.block_size
        and _whole_blocks(src_table, src.block_size, first, count, s_ids.size)
        and _whole_blocks(dst_table, dst.block_size, first, count, d_ids.size)
    ):
        raise ConfigError("a KV layout here is known only down to a head's whole block: tokens cannot be mapped")
    heads = np.arange(h0, h0 + nh, dtype=np.int64)
    srcs, dsts, lens = [], [], []
    for sp, dp in zip(sc.parts, dc.parts):
        whole = sp.token_stride == sp.cell_bytes and dp.token_stride == dp.cell_bytes
        starts, seg = _segments(first, count, src_table, src.block_size, dst_table, dst.block_size, whole)
        s_rel, d_rel = starts - src_table.first_token, starts - dst_table.first_token
        s_blk, d_blk = s_ids[s_rel // src.block_size], d_ids[d_rel // dst.block_size]
        s_off = (s_rel % src.block_size) * sp.token_stride
        d_off = (d_rel % dst.block_size) * dp.token_stride
        rows = np.arange(sp.rows, dtype=np.int64)
        # (heads x rows, 1) against (segments,)
        s_hr = ((heads - sc.first_head) * sc.head_stride)[:, None] + sp.offset + rows[None, :] * sp.row_stride
        d_hr = ((heads - dc.first_head) * dc.head_stride)[:, None] + dp.offset + rows[None, :] * dp.row_stride
        s_hr, d_hr = s_hr.reshape(-1, 1), d_hr.reshape(-1, 1)
        run = np.broadcast_to(seg * sp.cell_bytes, (s_hr.shape[0], seg.size)).ravel()
        for rs, rd in zip(src.regions, dst.regions):
            srcs.append((rs.base + s_blk * rs.block_stride + s_off + s_hr).ravel())
            dsts.append((rd.base + d_blk * rd.block_stride + d_off + d_hr).ravel())
            lens.append(run)
    s_all, d_all, l_all = coalesce(np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens))
    blocks = -(-(first + count - dst_table.first_token) // dst.block_size) - (first - dst_table.first_token) // dst.block_size
    return TransferPlan(s_all, d_all, l_all.astype(np.int64), int(blocks))


def plan_blocks(src: KVLayout, src_ids: Sequence[int], dst: KVLayout, dst_ids: Sequence[int]) -> TransferPlan:
    """Blocks paired one to one: whole blocks where both sides cut them alike (the same TP rank's
    heads, the same shapes), otherwise the heads both hold, cell by cell (another TP split)."""
    sc, dc = src.cells, dst.cells
    alike = sc is None or dc is None or (sc.first_head, sc.heads) == (dc.first_head, dc.heads)
    if alike and src.shape_signature() == dst.shape_signature():
        return plan_transfer(src, src_ids, dst, dst_ids)
    if src.block_size != dst.block_size:
        raise ConfigError(f"blocks of {src.block_size} and {dst.block_size} tokens cannot be paired one to one")
    if len(src_ids) != len(dst_ids):
        raise TransferParamsError(f"block id lists differ in length: {len(src_ids)} source vs {len(dst_ids)} destination")
    return plan_cells(src, BlockTable(src_ids), dst, BlockTable(dst_ids), 0, len(dst_ids) * dst.block_size)
