"""bench_faults.py's observations: P's held KV, D's transfer counters, a client that aborts, server logs,
and the built-in connector's lease default as its installed source states it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from kv_connectors.config import ConnectorConfig
from kvc_testing.cluster import metric, stats
from kvc_testing.procs import VllmServer

KV_USAGE = "vllm:kv_cache_usage_perc"
# vLLM's built-in NixlConnector's Prometheus counters on D (names as /metrics prints them).
BUILTIN_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
BUILTIN_FAILED = "vllm:nixl_num_failed_transfers_total"
BUILTIN_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"  # on P
POLL_S = 0.25


@dataclasses.dataclass(frozen=True)
class LeaseDefault:
    """How long P holds blocks for a D that never reads them, by default, and where that is stated."""

    seconds: float | None
    source: str


def ours_lease_default() -> LeaseDefault:
    field = next(f for f in dataclasses.fields(ConnectorConfig) if f.name == "lease_s")
    return LeaseDefault(float(field.default), "kv_connector_extra_config lease_s (kv_connectors/config.py)")


def _vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def builtin_lease_default() -> LeaseDefault:
    """The built-in's default lease: VLLM_NIXL_ABORT_REQUEST_TIMEOUT in vllm/envs.py where that exists,
    else the `kv_lease_duration` default of its scheduler (vLLM 0.32 replaced the variable by a lease)."""
    root = _vllm_root()
    if root is None:
        return LeaseDefault(None, "vLLM not installed")
    envs = (root / "envs.py").read_text()
    m = re.search(r"VLLM_NIXL_ABORT_REQUEST_TIMEOUT:\s*int\s*=\s*(\d+)", envs)
    if m:
        return LeaseDefault(float(m.group(1)), "VLLM_NIXL_ABORT_REQUEST_TIMEOUT (vllm/envs.py)")
    connector_dir = root / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    sources = sorted((connector_dir / "nixl").glob("*.py")) + [connector_dir / "nixl_connector.py"]
    for path in sources:
        if path.exists():
            m = re.search(r'"kv_lease_duration",\s*(\d+)', path.read_text())
            if m:
                rel = path.relative_to(root.parent)
                return LeaseDefault(
                    float(m.group(1)),
                    f"kv_connector_extra_config kv_lease_duration ({rel}); vllm/envs.py has no VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
                )
    return LeaseDefault(None, "not found in vllm/envs.py nor the NIXL connector's source")


def kv_usage(server: VllmServer) -> float:
    """P's share of KV blocks in use (vLLM's own gauge; blocks held for a D count, freed cached ones do not)."""
    return metric(server.url, KV_USAGE, missing_ok=True)


def ours_d_counters(d: VllmServer) -> dict[str, float]:
    """D's loads and failed loads (our side-channel stats: recv_transfers, recv_failures)."""
    s = stats(d)
    return {"transfers": s.recv_transfers, "failed": s.recv_failures}


def builtin_d_counters(d: VllmServer) -> dict[str, float]:
    """D's transfers and failed transfers (the built-in's /metrics; failures include handshakes, notifications)."""
    return {
        "transfers": metric(d.url, BUILTIN_TRANSFERS, missing_ok=True),
        "failed": metric(d.url, BUILTIN_FAILED, missing_ok=True),
    }


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def poll_until(
    probe: Callable[[], Any], done: Callable[[Any], bool], deadline_s: float, t0: float | None = None
) -> tuple[Any, float | None]:
    """Call probe() until done(value) or `deadline_s` after t0 (default now): (last value, seconds or None)."""
    t0 = time.monotonic() if t0 is None else t0
    while True:
        value = probe()
        elapsed = time.monotonic() - t0
        if done(value):
            return value, elapsed
        if elapsed > deadline_s:
            return value, None
        time.sleep(POLL_S)


def send_request(url: str, body: dict[str, Any]) -> socket.socket:
    """POST /v1/completions as raw HTTP and return the open socket: closing it is the client giving up."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    s = socket.create_connection((parts.hostname, parts.port), timeout=5)
    try:
        s.sendall(head + payload)
    except OSError:
        s.close()
        raise
    return s


def response_summary(r: httpx.Response) -> tuple[bool, str, list[int] | None]:
    """(failed, one-line description, output token ids if served)."""
    if r.status_code != 200:
        try:
            message = str(r.json().get("error", {}).get("message", r.text))
        except (ValueError, AttributeError):
            message = r.text
        return True, f"HTTP {r.status_code}: {' '.join(message.split())[:160]}", None
    choice = r.json()["choices"][0]
    if choice.get("finish_reason") == "error":
        return True, "HTTP 200 with finish_reason error", None
    return False, f"HTTP 200, finish_reason {choice.get('finish_reason')}", list(choice.get("token_ids") or [])


def log_message(server: VllmServer, patterns: Sequence[str], lines: int = 400) -> str | None:
    """The last log line containing the first of `patterns` found (most specific first), trimmed."""
    tail = server.log_tail(lines).splitlines()
    for pattern in patterns:
        for line in reversed(tail):
            if pattern in line:
                return " ".join(line.split())[:240]
    return None


def log_silent_s(server: VllmServer) -> float:
    """Seconds since the server last wrote to its log."""
    try:
        return time.time() - server.log_path.stat().st_mtime
    except OSError:
        return 0.0


def last_log_line(server: VllmServer) -> str:
    lines = [ln for ln in server.log_tail(20).splitlines() if ln.strip()]
    return " ".join(lines[-1].split())[:200] if lines else ""
