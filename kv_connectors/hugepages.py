"""Host KV memory backed by transparent huge pages, as the connector registers it (Linux).

vLLM allocates a CPU KV cache with PyTorch, which (unlike NumPy) does not ask for huge pages unless
THP_MEM_ALLOC_ENABLE=1; with THP in `madvise` mode (the common default) the cache then sits on 4 KiB
pages, and a NIXL READ over cma (process_vm_readv) between two processes walks and pins every one of
them. Measured here (benchmarks/transport/bench_transport.py, NIXL pull of 256 MiB in 16 KiB blocks,
sequential, alternating runs): 4 KiB pages 0.10-0.36 of memcpy, huge pages 0.44-0.99. At
registration the connector therefore advises huge pages over each host region and collapses the
pages already there (MADV_COLLAPSE, Linux 6.1+: the contents move to huge pages in place, same
addresses; 256 MiB took 85 ms here). Best effort: a kernel without it, THP off, or no free huge
pages leaves the memory as it was, and nothing else changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Iterable

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def huge_page_spans(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole huge pages inside each (base, length) range, merged where ranges touch: (start, length)."""
    spans: list[tuple[int, int]] = []
    for base, length in sorted(regions):
        start = -(-base // HUGE_PAGE) * HUGE_PAGE
        end = (base + length) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        if spans and start <= spans[-1][0] + spans[-1][1]:
            first = spans[-1][0]
            spans[-1] = (first, max(spans[-1][0] + spans[-1][1], end) - first)
        else:
            spans.append((start, end - start))
    return spans


def back_with_huge_pages(regions: Iterable[tuple[int, int]]) -> int:
    """Advise and collapse the huge pages inside each (base, length) host range; the bytes now on
    huge pages as far as the kernel said yes (0 where it cannot: not Linux, THP off, too old)."""
    madvise = _madvise()
    spans = huge_page_spans(regions)
    if madvise is None or not spans:
        return 0
    done = 0
    errors: set[int] = set()
    for start, length in spans:
        if madvise(start, length, MADV_HUGEPAGE) != 0:
            errors.add(ctypes.get_errno())
            continue
        if madvise(start, length, MADV_COLLAPSE) != 0:  # advised still: khugepaged collapses later
            errors.add(ctypes.get_errno())
            continue
        done += length
    total = sum(length for _, length in spans)
    if errors:
        logger.info(
            "host KV on huge pages: %d of %d MiB (madvise errno %s; THP off or no free huge pages leaves 4 KiB pages)",
            done >> 20,
            total >> 20,
            sorted(errors),
        )
    else:
        logger.debug("host KV on huge pages: %d MiB", done >> 20)
    return done
