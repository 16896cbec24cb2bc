"""UCX environment defaults for the NIXL transport, set before UCX first loads; a value the user set is left alone."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# UCX's TCP transport sends in segments of UCX_TCP_TX_SEG_SIZE (8 KiB by default); a READ over TCP
# is answered segment by segment, and at 8 KiB it ran at 0.57-0.63 of a plain socket's speed here.
TCP_TX_SEG_SIZE = "32k"


def apply_defaults() -> None:
    """Every default below, in order; UCX reads these variables once, when it initializes."""
    skip_ib_modules_without_rdma_devices()
    enable_cuda_ipc_get()
    larger_tcp_segments()


def skip_ib_modules_without_rdma_devices() -> None:
    """On hosts with no RDMA device, keep UCX from loading its InfiniBand modules.

    The nixl wheel bundles libibverbs and libnl; when the system's ibverbs providers are also
    installed (Mooncake needs libibverbs1), both copies of libnl end up in the process and it
    crashes in rtnl_tc_unregister at exit (SIGSEGV, seen with nixl 1.5.1). Without an RDMA
    device those modules are useless anyway. A UCX_MODULES set by the user is left alone.
    """
    if "UCX_MODULES" in os.environ:
        return
    ib = Path("/sys/class/infiniband")
    if ib.is_dir() and any(ib.iterdir()):
        return
    os.environ["UCX_MODULES"] = "^ib,rdmacm"
    logger.info("no RDMA device: UCX_MODULES=^ib,rdmacm (set UCX_MODULES to override)")


def enable_cuda_ipc_get() -> None:
    """Let UCX serve a READ of a same-node peer's GPU memory over cuda_ipc, as it serves a WRITE.

    UCX 1.23 (bundled with nixl 1.5.1) turns cuda_ipc GET off where it finds no NVLink
    (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto), so a pull of VRAM from a P on the same node falls back
    to a bounce through host memory: on an H200, 1 GiB of 16 KiB blocks moved at 0.53 GB/s by READ
    against 1559 GB/s by WRITE (benchmarks/bench_staging.py, vLLM issue 52607). Set only where an
    NVIDIA device is present (elsewhere UCX warns that the variable is unused); a value set by the
    user is left alone.
    """
    if "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in os.environ or not any(Path("/dev").glob("nvidia[0-9]*")):
        return
    os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "yes"
    logger.info("NVIDIA device: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=yes (same-node READs of GPU memory over cuda_ipc)")


def larger_tcp_segments() -> None:
    """Send UCX's TCP traffic (the no-RDMA path between hosts) in 32 KiB segments.

    Measured on one host, UCX_TLS=tcp, 256 MiB of 16 KiB blocks, in one session against a plain
    TCP socket moving the same bytes (benchmarks/bench_transport.py --tcp-baseline): NIXL pull
    sequential 0.61 -> 0.89-1.03 of the socket, shuffled 0.57 -> 0.72; push unchanged within noise
    (0.88-0.95); 64 KiB segments brought pull back to 0.64. Only the tcp transport reads it (shared
    memory, cma and RDMA do not). A value set by the user is left alone.
    """
    if "UCX_TCP_TX_SEG_SIZE" in os.environ:
        return
    os.environ["UCX_TCP_TX_SEG_SIZE"] = TCP_TX_SEG_SIZE
    logger.debug("UCX_TCP_TX_SEG_SIZE=%s (set it to override)", TCP_TX_SEG_SIZE)
