"""Host KV regions are moved onto transparent huge pages at registration (kv_connectors.hugepages)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kv_connectors.hugepages import HUGE_PAGE, back_with_huge_pages, huge_page_spans


def test_spans_are_the_whole_huge_pages_inside_each_range_merged():
    h = HUGE_PAGE
    assert huge_page_spans([(h + 5, 3 * h)]) == [(2 * h, 2 * h)]  # the partial pages at both ends are left
    assert huge_page_spans([(0, h - 1)]) == []
    assert huge_page_spans([(4 * h, h), (0, 2 * h), (2 * h, h)]) == [(0, 3 * h), (4 * h, h)]


def _huge_kib(base: int, length: int) -> int:
    """AnonHugePages of the mappings overlapping [base, base + length) (this process's smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            inside = lo < base + length and base < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def _thp_can_collapse() -> bool:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform.startswith("linux") and mode.exists() and "[never]" not in mode.read_text()


def test_a_torch_kv_tensor_moves_onto_huge_pages_with_its_contents():
    if not _thp_can_collapse():
        pytest.fail("this test needs Linux with transparent huge pages not set to never (CI's host has them)")
    t = torch.empty(32 << 20, dtype=torch.uint8)  # as vLLM's CPU KV cache: PyTorch asks for no huge pages
    t.copy_(torch.from_numpy(np.arange(t.numel(), dtype=np.uint64).astype(np.uint8)))
    want = t.clone()
    base, length = t.data_ptr(), t.numel()
    done = back_with_huge_pages([(base, length)])
    assert done >= length - 2 * HUGE_PAGE, f"only {done >> 20} MiB collapsed"
    assert _huge_kib(base, length) >= (length - 2 * HUGE_PAGE) >> 10, "the kernel said yes, smaps says 4 KiB pages"
    assert torch.equal(t, want), "the contents changed"
