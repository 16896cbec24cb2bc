"""The kernel's own cross-process copy of a plan's runs: process_vm_readv / process_vm_writev, the
system calls UCX's cma transport makes between two processes on one host. Timed over the same runs
of the same two processes as the transport, it is the ceiling a same-host NIXL transfer of that
block table can reach here, apart from memcpy's: a shuffled table costs the kernel a page-table walk
and a page pin per run, whoever asks.

Each call carries up to IOV_MAX runs (UCX's cma makes one call per descriptor); `threads` callers
split the runs between them (ctypes releases the GIL around each call)."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np

from kv_connectors.plan import TransferPlan

IOV_MAX = 1024  # the kernel's limit on iovecs per call (UIO_MAXIOV)

_libc = ctypes.CDLL(None, use_errno=True)
_SIGNATURE = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_readv = _libc.process_vm_readv
_writev = _libc.process_vm_writev
for _fn in (_readv, _writev):
    _fn.argtypes = _SIGNATURE
    _fn.restype = ctypes.c_ssize_t


def iovecs(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """struct iovec[] (base, len: two 64-bit words each) for the runs, as one C-contiguous array."""
    out = np.empty((addr.shape[0], 2), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = length
    return out


def vm_copy(pid: int, local: np.ndarray, remote: np.ndarray, write: bool) -> int:
    """Copy between our iovecs and process pid's (one run each, same lengths), IOV_MAX per call:
    read theirs into ours, or write ours into theirs. Returns the bytes moved; OSError on failure."""
    fn = _writev if write else _readv
    moved = 0
    for i in range(0, local.shape[0], IOV_MAX):
        lo, ro = local[i : i + IOV_MAX], remote[i : i + IOV_MAX]
        want = int(lo[:, 1].sum())
        n = fn(pid, lo.ctypes.data, lo.shape[0], ro.ctypes.data, ro.shape[0], 0)
        if n < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_{'writev' if write else 'readv'}({pid}): {os.strerror(err)}")
        if n != want:  # a partial copy: the kernel stops at the first fault
            raise OSError(0, f"process_vm_{'writev' if write else 'readv'}({pid}) moved {n} of {want} bytes")
        moved += n
    return moved


def cma_seconds(pid: int, plan: TransferPlan, write: bool, threads: int = 1) -> float:
    """Seconds to move the plan's runs with process pid by the kernel's cross-process copy: READ
    (plan.src in pid, plan.dst here) or WRITE (plan.src here, plan.dst in pid); `threads` callers
    each take a contiguous share of the runs."""
    local, remote = (plan.src, plan.dst) if write else (plan.dst, plan.src)
    lo, ro = iovecs(local, plan.length), iovecs(remote, plan.length)
    shares = [
        (np.ascontiguousarray(s), np.ascontiguousarray(r)) for s, r in zip(np.array_split(lo, threads), np.array_split(ro, threads))
    ]
    errors: list[BaseException] = []

    def work(share: tuple[np.ndarray, np.ndarray]) -> None:
        try:
            vm_copy(pid, share[0], share[1], write)
        except BaseException as e:  # re-raised below, on the calling thread
            errors.append(e)

    workers = [threading.Thread(target=work, args=(s,)) for s in shares[1:]]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    work(shares[0])
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def cma_gbps(pid: int, plan: TransferPlan, write: bool, repeat: int, threads: int = 1) -> list[float]:
    """GB/s of cma_seconds, repeat times."""
    return [plan.total_bytes / cma_seconds(pid, plan, write, threads) / 1e9 for _ in range(repeat)]
