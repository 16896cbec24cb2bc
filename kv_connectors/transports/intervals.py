"""Registered memory as address ranges, and the one check every transport makes of its own side's
runs before handing raw addresses to an engine or a memcpy: "is each (addr, length) run inside
them" (numpy, no per-run Python loop).

Semantics, the same for every caller:

- A range is half-open, [start, end). Empty ranges are ignored. Overlapping ranges are merged into
  one; touching ones (one's end is the next one's start) are not: they may be separate allocations
  or separate engine registrations, so a run must lie inside one range, never across two.
- A run (addr, length) is inside when some range has start <= addr and addr + length <= end: a run
  ending exactly at a range's end is inside, one byte longer is not.
- A run of length <= 0 is never inside. It moves nothing; the planners never make one
  (`plan_transfer` runs are whole segments, `chunk_plan` drops empty runs) and an engine may take an
  empty descriptor for an error, so every layer gives the same answer: refused.
- The comparison is `length <= end - addr`, never `addr + length <= end`: int64 run lists come from
  peers, and a length near 2**63 must not wrap around into "inside".
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kv_connectors.errors import TransportError

_INT64_MAX = (1 << 63) - 1


def merge_ranges(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) ranges sorted, overlapping ones merged, touching ones kept apart, empty ones dropped."""
    merged: list[list[int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in spans if e > s):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total_bytes(length: np.ndarray) -> int:
    """The exact sum of int64 lengths (numpy's int64 sum wraps past 2**63)."""
    if length.size == 0:
        return 0
    if int(np.abs(length).max()) <= _INT64_MAX // length.size:
        return int(length.sum())
    return sum(length.tolist())


class Ranges:
    """A growing set of registered address ranges (see the module docstring for the semantics)."""

    def __init__(self, spans: Iterable[tuple[int, int]] = ()) -> None:
        self._spans: list[tuple[int, int]] = []
        self._starts = np.zeros(0, np.int64)
        self._ends = np.zeros(0, np.int64)
        self.add(spans)

    def add(self, spans: Iterable[tuple[int, int]]) -> None:
        """Add (start, end) ranges; ones overlapping those already here are merged with them."""
        self._spans = merge_ranges([*self._spans, *spans])
        self._starts = np.array([s for s, _ in self._spans], np.int64)
        self._ends = np.array([e for _, e in self._spans], np.int64)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The merged (start, end) ranges, sorted."""
        return list(self._spans)

    def __len__(self) -> int:
        return len(self._spans)

    def inside(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Per run, whether it lies inside one range (bool array, addr's shape)."""
        addr = np.asarray(addr, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        if not self._spans:
            return np.zeros(addr.shape, dtype=bool)
        idx = np.searchsorted(self._starts, addr, side="right") - 1
        # addr >= start >= 0 wherever idx >= 0, so end - addr cannot overflow
        room = self._ends[np.maximum(idx, 0)] - addr
        ok: np.ndarray = (idx >= 0) & (length > 0) & (length <= room)
        return ok

    def first_outside(self, addr: np.ndarray, length: np.ndarray) -> int | None:
        """Index of the first run not inside, or None when every run is."""
        ok = self.inside(addr, length)
        return None if ok.all() else int(np.flatnonzero(~ok)[0])

    def check(self, addr: np.ndarray, length: np.ndarray, what: str, memory: str = "memory") -> None:
        """Raise TransportError naming the first run that is not inside (and what it was for)."""
        if addr.size == 0:
            return
        if not self._spans:
            raise TransportError(f"{what}: no {memory} is registered")
        bad = self.first_outside(addr, length)
        if bad is not None:
            raise TransportError(
                f"{what}: run {bad} ({int(addr[bad]):#x}, {int(length[bad])} bytes) is not inside registered {memory}"
            )
