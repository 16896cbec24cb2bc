"""Chunking of a transfer plan into pool-slot-sized chunks of runs."""

from __future__ import annotations

import dataclasses

import numpy as np

from kv_connectors.plan import TransferPlan


@dataclasses.dataclass(frozen=True)
class Chunks:
    """A plan's runs cut into chunks. Piece i copies length[i] bytes src[i] -> dst[i] and sits at
    slot_off[i] in its chunk's slot; chunk k is pieces bounds[k]:bounds[k+1], packed from offset 0."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    slot_off: np.ndarray
    bounds: np.ndarray

    @property
    def num_chunks(self) -> int:
        return int(self.bounds.shape[0]) - 1

    def pieces(self, k: int) -> slice:
        return slice(int(self.bounds[k]), int(self.bounds[k + 1]))

    def nbytes(self, k: int) -> int:
        return int(self.length[self.pieces(k)].sum())


def chunk_plan(plan: TransferPlan, chunk_bytes: int, max_runs: int) -> Chunks:
    """Cut the runs, read as one byte stream, at every multiple of chunk_bytes (a longer run is
    split); a chunk with more than max_runs pieces is split again. Empty runs are dropped."""
    keep = plan.length > 0
    src, dst = plan.src[keep].astype(np.int64), plan.dst[keep].astype(np.int64)
    length = plan.length[keep].astype(np.int64)
    if length.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Chunks(empty, empty, empty, empty, np.zeros(1, dtype=np.int64))
    ends = np.cumsum(length)
    starts = ends - length
    total = int(ends[-1])
    points = np.union1d(starts, np.arange(chunk_bytes, total, chunk_bytes, dtype=np.int64))
    run = np.searchsorted(ends, points, side="right")
    offset = points - starts[run]
    byte_chunk = points // chunk_bytes
    rank = np.arange(points.size) - np.searchsorted(byte_chunk, byte_chunk, side="left")
    first = rank % max_runs == 0
    bounds = np.append(np.flatnonzero(first), points.size).astype(np.int64)
    chunk_of = np.cumsum(first) - 1
    return Chunks(
        src=src[run] + offset,
        dst=dst[run] + offset,
        length=np.diff(np.append(points, total)),
        slot_off=points - points[bounds[:-1]][chunk_of],
        bounds=bounds,
    )


def one_run(src: int, dst: int, n: int) -> TransferPlan:
    """A plan of one run (n bytes src -> dst)."""
    return TransferPlan(np.array([src], np.int64), np.array([dst], np.int64), np.array([n], np.int64), 0)
