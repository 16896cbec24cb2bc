"""The kernel baseline of bench_transport (--cma-baseline): process_vm_readv/writev over a plan's runs
moves exactly those runs, across the IOV_MAX batching and split between threads, and a fault is an
error, never a short figure. The calls are made on this process's own pid (the kernel takes the same
path for any process it may trace)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks.transport import kernel
from kv_connectors.plan import TransferPlan

RUN = 64


def shuffled_plan(src: np.ndarray, dst: np.ndarray, runs: int, seed: int = 0) -> TransferPlan:
    rng = np.random.default_rng(seed)
    s, d = rng.permutation(runs), rng.permutation(runs)
    return TransferPlan(
        src=(src.ctypes.data + s * RUN).astype(np.int64),
        dst=(dst.ctypes.data + d * RUN).astype(np.int64),
        length=np.full(runs, RUN, dtype=np.int64),
        num_blocks=runs,
    )


def expected(src: np.ndarray, plan: TransferPlan, base: int, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.uint8)
    for s, d in zip(plan.src.tolist(), plan.dst.tolist()):
        out[d - base : d - base + RUN] = src[s - src.ctypes.data : s - src.ctypes.data + RUN]
    return out


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("write", [False, True])
def test_the_plans_runs_move_across_call_batches_and_threads(write: bool, threads: int) -> None:
    runs = kernel.IOV_MAX + 500  # two calls' worth on one thread
    src = np.random.default_rng(1).integers(0, 255, runs * RUN, dtype=np.uint8)
    dst = np.zeros(runs * RUN, dtype=np.uint8)
    plan = shuffled_plan(src, dst, runs)
    seconds = kernel.cma_seconds(os.getpid(), plan, write, threads)
    assert seconds > 0
    assert np.array_equal(dst, expected(src, plan, dst.ctypes.data, dst.size))


def test_iovecs_are_base_and_length_words() -> None:
    iov = kernel.iovecs(np.array([4096, 8192]), np.array([16, 32]))
    assert iov.dtype == np.uint64 and iov.flags.c_contiguous
    assert iov.tolist() == [[4096, 16], [8192, 32]]


def test_a_run_outside_the_process_memory_is_an_error() -> None:
    dst = np.zeros(RUN, dtype=np.uint8)
    local = kernel.iovecs(np.array([dst.ctypes.data]), np.array([RUN]))
    remote = kernel.iovecs(np.array([8]), np.array([RUN]))  # page 0 is never mapped
    with pytest.raises(OSError, match="process_vm_readv"):
        kernel.vm_copy(os.getpid(), local, remote, write=False)


def test_gbps_is_bytes_over_seconds() -> None:
    src = np.ones(8 * RUN, dtype=np.uint8)
    dst = np.zeros(8 * RUN, dtype=np.uint8)
    plan = shuffled_plan(src, dst, 8)
    figures = kernel.cma_gbps(os.getpid(), plan, False, repeat=2)
    assert len(figures) == 2 and all(f > 0 for f in figures)
    assert dst.all()
