"""Third-party routers in front of our P and D servers: vllm-router (PD mode) and SMG, pinned, installed
from PyPI into their own venv (.venv/routers, created on first use, reused after), run as child
processes in their own process group on free ports."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvc_testing.procs import ManagedProcess, free_ports

ROOT = Path(__file__).resolve().parents[1]
ROUTERS_VENV = ROOT / ".venv" / "routers"
# The versions the compatibility suite runs (docs/deploying-behind-routers.md names them too).
PINS = {"vllm-router": "0.1.17", "smg": "1.13.0"}
_STAMP = ".kvc-routers"


def _pins_line() -> str:
    return " ".join(f"{name}=={version}" for name, version in sorted(PINS.items()))


@contextlib.contextmanager
def _install_lock(venv: Path) -> Iterator[None]:
    """One installer at a time (two test sessions on one checkout share the venv)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".routers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(argv: Sequence[str], what: str, timeout: float) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )


def base_python() -> str:
    """An interpreter outside any venv, so that the routers' venv does not see the test venv's packages."""
    base = Path(getattr(sys, "_base_executable", "") or sys.executable)
    return str(base if base.exists() else sys.executable)


def ensure_routers(venv: Path = ROUTERS_VENV, timeout: float = 900.0) -> Path:
    """The venv holding vllm-router and smg at PINS, created and installed with pip where missing or
    at other versions; returns its bin folder. A failed install raises with pip's own output."""
    stamp = venv / _STAMP
    with _install_lock(venv):
        if stamp.exists() and stamp.read_text().strip() == _pins_line() and all((venv / "bin" / n).exists() for n in PINS):
            return venv / "bin"
        shutil.rmtree(venv, ignore_errors=True)
        _run([base_python(), "-m", "venv", str(venv)], f"creating {venv}", timeout)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _run([*pip, *(f"{n}=={v}" for n, v in sorted(PINS.items()))], "pip install of the routers", timeout)
        missing = [n for n in PINS if not (venv / "bin" / n).exists()]
        if missing:
            raise RuntimeError(f"pip installed the routers but {venv / 'bin'} has no {missing}")
        stamp.write_text(_pins_line() + "\n")
    return venv / "bin"


class RouterProcess(ManagedProcess):
    """A router command (argv after its executable) on a free port and a free Prometheus port."""

    def __init__(self, bin_dir: Path, command: str, args: Sequence[str], *, name: str) -> None:
        self.port, self.prometheus_port = free_ports(2)
        self.command = command
        self.args = [str(a) for a in args]
        argv = [str(bin_dir / command), *self.cli_args()]
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(NO_COLOR="1", RUST_LOG_STYLE="never")
        super().__init__(argv, name=name, env=env)

    def cli_args(self) -> list[str]:
        """The arguments after the executable, as a user types them (docs quote them)."""
        where = ["--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(self.prometheus_port)]
        return ["launch", *self.args, *where] if self.command == "smg" else [*self.args, *where]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> RouterProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise RuntimeError(f"{self.name} exited with {self.returncode}:\n{self.log_tail(40)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:g} s:\n{self.log_tail(40)}")


def vllm_router(
    bin_dir: Path, prefill: Sequence[str], decode: Sequence[str], *extra: str, name: str = "vllm-router"
) -> RouterProcess:
    """`vllm-router --vllm-pd-disaggregation --kv-connector nixl --prefill P... --decode D...`."""
    args = ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for url in prefill:
        args += ["--prefill", url]
    for url in decode:
        args += ["--decode", url]
    return RouterProcess(bin_dir, "vllm-router", [*args, *extra], name=name)


def smg(bin_dir: Path, *args: str, name: str = "smg") -> RouterProcess:
    """`smg launch --pd-disaggregation ...`: no workers on the command line, they are registered with
    register_smg_worker (the CLI's --prefill/--decode register no KV connector: see smg_cli_trap)."""
    return RouterProcess(bin_dir, "smg", ["--pd-disaggregation", *args], name=name)


def smg_worker_spec(url: str, role: str) -> dict[str, Any]:
    """The POST /workers body that makes SMG run its vLLM NIXL flow for a worker (role: prefill or decode)."""
    return {
        "url": url,
        "worker_type": role,
        "runtime_type": "vllm",
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
    }


def register_smg_workers(router: RouterProcess, prefill: Sequence[str], decode: Sequence[str], timeout: float = 60.0) -> None:
    """Register each server with SMG's admin API and wait until SMG lists them all ready."""
    specs = [smg_worker_spec(u, "prefill") for u in prefill] + [smg_worker_spec(u, "decode") for u in decode]
    for spec in specs:
        r = httpx.post(f"{router.url}/workers", json=spec, timeout=10)
        if r.status_code // 100 != 2:
            raise RuntimeError(f"SMG refused worker {spec}: {r.status_code} {r.text[:500]}")
    want = {(s["url"], s["worker_type"]) for s in specs}
    deadline = time.monotonic() + timeout
    while True:
        workers = httpx.get(f"{router.url}/workers", timeout=10).json().get("workers", [])
        ready = {(w["url"], w["worker_type"]) for w in workers if w.get("is_healthy") and w.get("status") == "ready"}
        if want <= ready:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"SMG lists {workers} after {timeout:g} s, not all of {sorted(want)} ready")
        time.sleep(0.3)
